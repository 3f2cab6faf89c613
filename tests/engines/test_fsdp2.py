"""MoeFsdp2Engine on 2 gloo ranks against single-process plain autograd through the same spec.

Tolerances (fp32 everywhere): log-probs / entropy max abs 1e-5; loss, grad norm relative 1e-5;
updated weights rel RMS 1e-5 per tensor, and the update itself (new - old weights) rel RMS 1e-4.
"""

from __future__ import annotations

import math

import pytest
import torch
import verl_moe.models as vm
from dist import spawn
from engine_setup import (
    build_engine,
    check_delta_weight_sync,
    fixed_ppo_batch,
    grpo_actor_config,
    make_batch,
    ppo_loss_fn,
    rank_slice,
    reference_log_probs,
    reference_train_step,
    with_ppo_fields,
    write_tiny_model,
)
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import no_padding_2_padding
from verl_moe.ops.compare import assert_rel_rms

BATCH, PROMPT, RESPONSE = 8, 6, 7


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _train_and_compare(engine, reference, ref_optim, data, rank, world_size, **switches):
    """One engine step on this rank's slice vs one reference step on the whole batch."""
    actor_config = grpo_actor_config()
    loss_fn = ppo_loss_fn(actor_config)
    before = {name: t.detach().clone() for name, t in reference.state_dict().items()}
    ref_loss, ref_norm = reference_train_step(reference, ref_optim, data.clone(), loss_fn, clip_grad=1.0)
    local = rank_slice(data, rank, world_size)
    tu.assign_non_tensor(local, global_batch_size=len(data), **switches)
    with engine.train_mode():
        out = engine.train_batch(local, loss_fn)
    loss = torch.tensor(sum(out["loss"]))
    torch.distributed.all_reduce(loss)  # TrainingWorker reports the dp-average of per-rank sums
    assert _rel(loss.item() / world_size, ref_loss) < 1e-5, (loss.item() / world_size, ref_loss)
    assert _rel(out["metrics"]["grad_norm"], ref_norm) < 1e-5, (out["metrics"]["grad_norm"], ref_norm)
    assert out["metrics"]["grad_norm_nonfinite"] == [0.0]
    full, _ = engine.get_per_tensor_param(layout="hf")
    ref_state = reference.state_dict()
    for name, tensor in full:
        assert_rel_rms(name, ref_state[name], tensor, 1e-5)
        # the step itself, not just the weights: Adam divides by sqrt(v), so entries with tiny
        # gradients amplify fp32 reduction-order noise (measured <= 3.3e-5)
        assert_rel_rms(f"update of {name}", ref_state[name] - before[name], tensor - before[name], 1e-4)


def _two_ranks_vs_single_process(rank: int, world_size: int, path: str) -> None:
    engine = build_engine(path)
    reference = vm.from_pretrained(path)
    data = make_batch(BATCH, PROMPT, RESPONSE, seed=3, temperature=torch.linspace(0.7, 1.3, BATCH))

    # infer: per-sample temperature, entropy on, dynamic micro-batching
    local = rank_slice(data, rank, world_size)
    tu.assign_non_tensor(local, calculate_entropy=True, use_dynamic_bsz=True, max_token_len_per_gpu=20)
    with engine.eval_mode():
        out = engine.infer_batch(local)
    with torch.no_grad():
        ref_lp, ref_ent = reference_log_probs(reference, local)
    for key, ref in (("log_probs", ref_lp), ("entropy", ref_ent)):
        got = no_padding_2_padding(out["model_output"][key], local)
        diff = (got - no_padding_2_padding(ref, local)).abs() * local["response_mask"]
        assert diff.max().item() <= 1e-5, (key, diff.max().item())

    # train, GRPO loss: step 1 micro-batches by count, step 2 by token budget (grad accumulation)
    with torch.no_grad():
        full_lp, _ = reference_log_probs(reference, data)
    data = with_ppo_fields(data, full_lp, seed=4)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999))
    _train_and_compare(engine, reference, ref_optim, data, rank, world_size,
                       use_dynamic_bsz=False, micro_batch_size_per_gpu=2)  # fmt: skip
    _train_and_compare(engine, reference, ref_optim, data, rank, world_size,
                       use_dynamic_bsz=True, max_token_len_per_gpu=24)  # fmt: skip

    # a non-finite gradient norm skips the step, reports it, and leaves the weights alone
    before = {name: t.clone() for name, t in engine.get_per_tensor_param(layout="hf")[0]}
    local = rank_slice(data, rank, world_size)
    tu.assign_non_tensor(local, global_batch_size=BATCH, use_dynamic_bsz=False, micro_batch_size_per_gpu=2)

    def poisoned_loss(**kwargs):
        loss, metrics = ppo_loss_fn(grpo_actor_config())(**kwargs)
        return loss * float("nan"), metrics

    with engine.train_mode():
        out = engine.train_batch(local, poisoned_loss)
    assert out["metrics"]["grad_norm_nonfinite"] == [1.0] and math.isnan(out["metrics"]["grad_norm"])
    for name, tensor in engine.get_per_tensor_param(layout="hf")[0]:
        assert torch.equal(tensor, before[name]), name


@pytest.mark.dist
def test_two_ranks_equal_single_process_autograd(tmp_path):
    path = write_tiny_model(str(tmp_path / "model"))
    spawn(_two_ranks_vs_single_process, 2, path)


def _memory_switches_do_not_change_numbers(rank: int, world_size: int, path: str, ckpt_dir: str) -> None:
    no_ac = {"enable_gradient_checkpointing": False}
    variants = {
        "baseline": dict(model=no_ac),
        "activation_checkpointing": dict(model={"enable_gradient_checkpointing": True}),
        "param_and_optimizer_offload": dict(model=no_ac, param_offload=True, optimizer_offload=True),
        "fsdp2_cpu_offload_policy": dict(model=no_ac, offload_policy=True),
        "hybrid_shard": dict(model=no_ac, fsdp_size=1),  # 2-D mesh: replicate 2 x shard 1
    }
    loss_fn = ppo_loss_fn(grpo_actor_config())
    results = {}
    for variant, overrides in variants.items():
        engine = build_engine(path, **overrides)
        mlp_calls = []  # a pre-hook: checkpoint's early stop can end a recompute before a post-hook fires
        engine.module.model.model.layers[0].mlp.register_forward_pre_hook(
            lambda *args, calls=mlp_calls: calls.append(1)
        )
        for step in range(2):
            local = fixed_ppo_batch(BATCH, PROMPT, RESPONSE, 10 + step, rank, world_size)
            with engine.train_mode():
                out = engine.train_batch(local, loss_fn)
        micro_batches = 2 * (BATCH // world_size // 2)
        assert len(mlp_calls) == micro_batches * (2 if variant == "activation_checkpointing" else 1), variant
        # a checkpoint round trip under each placement must see one device and restore exactly
        engine.save_checkpoint(f"{ckpt_dir}/{variant}")
        engine.load_checkpoint(f"{ckpt_dir}/{variant}")
        gen, _ = engine.get_per_tensor_param(layout="hf")
        results[variant] = (out["metrics"]["grad_norm"], {name: t.clone() for name, t in gen})
    base_norm, base_weights = results.pop("baseline")
    hsdp_norm, hsdp_weights = results.pop("hybrid_shard")  # all-reduce instead of reduce-scatter: fp order
    assert _rel(hsdp_norm, base_norm) < 1e-6
    for name, tensor in base_weights.items():
        assert_rel_rms(f"hybrid shard {name}", tensor, hsdp_weights[name], 1e-6)
    for variant, (norm, weights) in results.items():
        assert norm == base_norm, variant
        for name, tensor in base_weights.items():
            assert torch.equal(weights[name], tensor), (variant, name)

    # bf16 compute (verl's default mixed precision): the router alone keeps fp32 weights
    engine = build_engine(path, mixed_precision=None)
    seen = {}
    mlp = engine.module.model.model.layers[0].mlp
    mlp.gate.register_forward_pre_hook(lambda m, args: seen.update(router=m.weight.dtype))
    mlp.experts.register_forward_pre_hook(lambda m, args: seen.update(experts=m.gate_up_proj.dtype))
    data = rank_slice(make_batch(BATCH, PROMPT, RESPONSE, seed=10), rank, world_size)
    with engine.eval_mode():
        log_probs = engine.infer_batch(data)["model_output"]["log_probs"]
    assert seen == {"router": torch.float32, "experts": torch.bfloat16}
    assert log_probs.dtype == torch.float32 and torch.isfinite(log_probs.values()).all()


@pytest.mark.dist
def test_checkpointing_and_offload_equal_baseline(tmp_path):
    path = write_tiny_model(str(tmp_path / "model"))
    spawn(_memory_switches_do_not_change_numbers, 2, path, str(tmp_path / "ckpt"))


def _deterministic_step(rank: int, world_size: int, path: str, out: str) -> None:
    from verl_moe.ops import device

    engine = build_engine(path, full_determinism=True, seed=7)
    assert torch.are_deterministic_algorithms_enabled() and device.deterministic()
    data = fixed_ppo_batch(BATCH, PROMPT, RESPONSE, 3, rank, world_size)
    with engine.train_mode():
        metrics = engine.train_batch(data, ppo_loss_fn(grpo_actor_config()))["metrics"]
    weights = {name: t.clone() for name, t in engine.get_per_tensor_param(layout="hf")[0]}
    torch.save({"grad_norm": metrics["grad_norm"], "weights": weights}, out)


@pytest.mark.dist
def test_full_determinism_reproduces_bits_across_processes(tmp_path):
    """verl's `full_determinism` turns on torch's deterministic algorithms and our kernels' fixed
    configs; two processes then train to the same bits."""
    path = write_tiny_model(str(tmp_path / "model"))
    runs = []
    for i in range(2):
        spawn(_deterministic_step, 1, path, str(tmp_path / f"run{i}.pt"))
        runs.append(torch.load(tmp_path / f"run{i}.pt"))
    assert runs[0]["grad_norm"] == runs[1]["grad_norm"]
    assert runs[0]["weights"].keys() == runs[1]["weights"].keys()
    for name, tensor in runs[0]["weights"].items():
        assert torch.equal(tensor, runs[1]["weights"][name]), name


def _delta_weight_sync(rank: int, world_size: int, path: str) -> None:
    check_delta_weight_sync(build_engine(path), rank, world_size, BATCH, PROMPT, RESPONSE)


@pytest.mark.dist
def test_delta_weight_sync_reproduces_the_full_export(tmp_path):
    path = write_tiny_model(str(tmp_path / "model"))
    spawn(_delta_weight_sync, 2, path)
