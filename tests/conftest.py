"""Shared test setup: GPU tests skip without an accelerator; test modules that need verl skip with the
reason where it is not installed; fixed seeds; NaN-poisoned `torch.empty` in op tests so tiles a kernel
forgets to write show up as NaN."""

from __future__ import annotations

import importlib.util
import os
import re

import pytest
import torch
from verl_moe.ops import device

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# verl picks its platform once per process, at the first use; any test module that imports verl
# may trigger that during collection, so the choice must be made here, before all of them.
if not device.is_accelerator():
    os.environ.setdefault("VERL_PLATFORM", "cpu")
    # Triton kernels run in the interpreter on CPU. `triton.jit` reads this when a kernel module is
    # first imported, and any test module may import one during collection: decide it here.
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Top-level imports that need verl (and its Ray / TransferQueue / Hydra stack): verl, our engines and tools. A
# GPU machine with only torch, Triton and transformers still runs every ops / models test.
_NEEDS_VERL = re.compile(r"^(?:from|import)\s+(?:verl|verl_moe\.engines|verl_moe\.tools|hydra|omegaconf)\b", re.M)
_VERL_MISSING = importlib.util.find_spec("verl") is None


class _NeedsVerl(pytest.Module):
    """A test module that imports verl, on a machine without it: reported skipped with the reason."""

    def collect(self):
        pytest.skip("needs verl and its dependencies (pip install verl-moe installs them)")


def pytest_pycollect_makemodule(module_path, parent):
    if _VERL_MISSING and module_path.name.startswith("test_") and _NEEDS_VERL.search(module_path.read_text()):
        return _NeedsVerl.from_parent(parent, path=module_path)
    return None


def pytest_collection_modifyitems(config, items):
    if device.is_accelerator():
        return
    skip = pytest.mark.skip(reason="needs a cuda/npu device; the same property is tested at small size on CPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def nan_poison(monkeypatch):
    """Make float `torch.empty`/`torch.empty_like` return NaN-filled tensors for this test."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))
    yield
