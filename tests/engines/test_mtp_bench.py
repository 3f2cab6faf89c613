"""`benchmarks/mtp_bench.py` on CPU: its synthetic corpus has the entropy it reports (against the corpus's own
samples), and a tiny smoke run trains, serves and writes the report the GPU run writes.

Tolerances:
| what                                                         | tol                         |
| chain entropy vs mean -log P of 60k sampled transitions      | 0.03 nats (~6 std. errors)  |
"""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest
import torch

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.fixture(scope="module")
def mtp_bench():
    spec = importlib.util.spec_from_file_location("mtp_bench", os.path.join(ROOT, "benchmarks", "mtp_bench.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chain_entropy_is_the_samples_mean_surprise(mtp_bench):
    chain = mtp_bench.Chain.random(50, 4, seed=3)
    seqs = chain.sample(300, 220, torch.Generator().manual_seed(4))[:, 20:]  # past the uniform start
    prev, nxt = seqs[:, :-1], seqs[:, 1:]
    probs = (chain.successors[prev] == nxt[..., None]).to(torch.float64) * chain.probs[prev]
    surprise = -probs.sum(-1).log()
    assert torch.isfinite(surprise).all()  # every sampled transition is one of the chain's
    assert abs(surprise.mean().item() - chain.entropy()) < 0.03
    assert 0.9 < chain.entropy() < 1.3  # Dirichlet(1) over 4 successors: about 1.08 nats


def test_smoke_run_writes_the_report(mtp_bench, tmp_path):
    path = str(tmp_path / "mtp.json")
    args = "--tiny --states 40 --vocab 48 --train-seconds 60 --train-steps 15 --batch 4 --seq-len 32"
    args += f" --dtype fp32 --requests 1,3 --k 1,2 --new-tokens 6 --json {path}"
    report = mtp_bench.main(args.split())
    with open(path) as f:
        assert json.load(f)["records"] == report["records"]
    assert report["train_steps"] == 15 and math.isfinite(report["loss"]) and math.isfinite(report["mtp_loss"])
    assert 0 < report["mean_entropy"] <= math.log(48) + 1e-6
    assert [(r["requests"], r["k"]) for r in report["records"]] == [(1, 1), (1, 2), (3, 1), (3, 2)]
    for r in report["records"]:
        assert r["tokens"] == 6 * r["requests"] and 0.0 <= r["acceptance"] <= 1.0
        assert r["speedup"] == pytest.approx(r["spec_tokens_per_s"] / r["plain_tokens_per_s"])
