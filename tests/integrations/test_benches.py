"""The integration benchmarks' step code (`verl-moe bench veomni` / `transformers`) on the tiny config in fp32.

On CPU the bench runner skips them (the reduced model needs an accelerator); their builders and steps are
run here directly: the patched transformers step equals the unpatched one (loss rel 1e-5, as
test_transformers.py), VeOmni's step with `verl_moe` slots gives a finite loss and gradient.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import tiny_qwen3_5_moe_text
from verl_moe.ops import device
from verl_moe.ops.compare import rel_rms
from verl_moe.tools.bench import BenchConfig, bench_ops, run
from verl_moe.tools.bench import transformers as transformers_bench

TOL = 1e-5
CASE = {"id": "tiny", "layers": 3, "tokens": 24, "sequences": 2}


@pytest.fixture(autouse=True)
def _our_triton_kernels(monkeypatch):
    if not device.is_accelerator():
        monkeypatch.setenv("VERL_MOE_OPS", "triton")  # our Triton kernels, in the interpreter


def _inputs(bench):
    batch = bench.make_batch(CASE, device.current_device(), config=tiny_qwen3_5_moe_text(), dtype=torch.float32)
    return {**batch, "models": {}}


def test_transformers_bench_step():
    inputs = _inputs(transformers_bench)
    # one sequence: transformers' GatedDeltaNet ignores packing
    inputs["position_ids"] = torch.arange(CASE["tokens"], device=inputs["input_ids"].device)[None]
    losses = {p: transformers_bench.run(p, inputs, "fwd_bwd")[0] for p in transformers_bench.PROVIDERS}
    assert rel_rms(losses["transformers"], losses["verl_moe"]) <= TOL
    assert rel_rms(losses["transformers"], losses["transformers_torch"]) <= TOL
    patched = inputs["models"]["verl_moe"].model.layers[0].mlp.experts
    assert "forward" in vars(patched) and "forward" not in vars(
        inputs["models"]["transformers"].model.layers[0].mlp.experts
    )
    row = transformers_bench.derived(CASE, "verl_moe", "fwd_bwd", inputs, 10.0, 0.0)
    assert row["tokens_per_s"] == pytest.approx(CASE["tokens"] / 0.01) and row["mfu"] > 0


def test_veomni_bench_step(restore_veomni_state):
    veomni_bench = pytest.importorskip("verl_moe.tools.bench.veomni")
    pytest.importorskip("veomni")
    from verl_moe.integrations import veomni as integration

    integration.register()
    inputs = _inputs(veomni_bench)
    loss = veomni_bench.run("verl_moe", inputs, "fwd_bwd")[0]
    assert math.isfinite(loss.item())
    model = inputs["models"]["verl_moe"][0]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert inputs["models"]["verl_moe"][1]["loss"]["ForCausalLM"].__name__ == "verl_moe_causal_lm_loss"


def test_bench_runner_knows_them():
    assert {"veomni", "transformers"} <= set(bench_ops())
    if device.is_accelerator():
        pytest.skip("on an accelerator the runner would time the reduced model")
    report = run(BenchConfig(op="transformers"))
    assert report["rows"] == []
    assert set(report["skipped_providers"]) == set(transformers_bench.PROVIDERS)
    assert "needs an accelerator" in report["skipped_providers"]["verl_moe"]
