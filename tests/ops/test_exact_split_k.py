"""`benchmarks/exact_split_k.py` (a prototype for exact mode's projections) in the Triton interpreter: K split in
fixed parts summed in order gives a row the same bits as a batch of its own (`split` form) and inside a larger
batch (`fused` form), whatever the split; a different split, or none, changes the bits (so the check can fail)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.fixture(scope="module")
def split_k():
    path = os.path.join(ROOT, "benchmarks", "exact_split_k.py")
    spec = importlib.util.spec_from_file_location("exact_split_k", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("split", [1, 2, 3])
def test_split_and_fused_forms_give_a_row_the_same_bits(split_k, split):
    assert split_k.check(5, 37, 70, 600, split, torch.float32, torch.device("cpu"))


def test_another_split_changes_the_bits(split_k):
    torch.manual_seed(0)
    x, w = torch.randn(37, 600), torch.randn(70, 600) / 600**0.5
    few = split_k.split_linear(x[:5].contiguous(), w, 2, fused=False)
    for other in (1, 3):
        assert not torch.equal(few, split_k.split_linear(x, w, other, fused=True)[:5])
    reference = x[:5].double() @ w.double().T
    assert (few.double() - reference).abs().max() < 1e-4
