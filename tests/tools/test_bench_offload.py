"""`verl-moe bench model --offload`: the option reaches the model step (CPU, a tiny config in place of the
reduced model, which needs an accelerator). With checkpointing, offload must leave the step's loss and
gradients bit for bit as they were, while the offload held host memory (the row's host_gib)."""

import pytest
import torch
from transformers import Qwen3_5MoeTextConfig
from verl_moe.tools import bench
from verl_moe.tools.bench import model as model_bench

CASE = {"id": "tiny-T48-ckpt", "layers": 3, "tokens": 48, "sequences": 3, "checkpoint": True}


def _tiny(layers: int) -> Qwen3_5MoeTextConfig:
    return Qwen3_5MoeTextConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=layers, full_attention_interval=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        tie_word_embeddings=False,
    )  # fmt: skip


def _step(offload: bool):
    inputs = model_bench.make_inputs({**CASE, "offload": offload}, torch.device("cpu"))
    loss = model_bench.run("ours", inputs, "fwd_bwd")[0]
    grads = {n: p.grad for n, p in inputs["ours"].named_parameters() if p.grad is not None}
    return inputs, loss, grads


def test_offload_leaves_the_step_unchanged(monkeypatch):
    monkeypatch.setattr(model_bench, "reduced_config", _tiny)
    _, loss, grads = _step(offload=False)
    inputs, loss_offload, grads_offload = _step(offload=True)
    assert inputs["offload"].packed_tensors > 0
    assert torch.equal(loss, loss_offload)
    assert sorted(grads) == sorted(grads_offload) and all(torch.equal(grads[k], grads_offload[k]) for k in grads)
    row = model_bench.derived(CASE, "ours", "fwd_bwd", inputs, ms=1.0, peak_extra_gib=0.0)
    assert row["host_gib"] * 1024**3 == inputs["offload"].peak_host_bytes > 0


def test_long_cases_run_ours_only_and_options_are_per_op():
    long = [c for c in model_bench.CASES if c["id"].endswith("-ckpt")]
    assert [c["tokens"] for c in long] == [32768, 131072, 262144]
    assert all(c["checkpoint"] and c["providers"] == ("ours",) for c in long)
    with pytest.raises(ValueError, match=r"unknown options \['offload'\] for op logprob"):
        bench.run(bench.BenchConfig(op="logprob", extra={"offload": True}))
