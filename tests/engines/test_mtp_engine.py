"""The MTP loss (verl's `model.mtp`: enable, enable_train, mtp_loss_scaling_factor) through our engines on
2 gloo ranks, against plain autograd in one process over the whole batch: verl's SFT loss plus the factor
times the MTP cross-entropy averaged over the valid positions (token t+k+1 in t's sequence and in
loss_mask), written here one sequence at a time. Two micro-batches per rank, so the mean must hold across
micro-batches and ranks; fsdp2, and veomni with the experts (the MTP layer's too) split over 2 ranks. The
trained MTP weights then reach the rollout through the weight sync. With model.mtp off (verl's default) a
checkpoint with MTP tensors loads without them. Configuration errors, and where an RL batch's loss mask
sits, without ranks.

Tolerances (fp32): loss relative 1e-5; gradients per parameter relative 1e-4.
"""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch
import torch.nn.functional as F
import verl_moe.models as vm
from engine_setup import _new_engine, build_engine, make_batch, rank_slice, reference_log_probs, tiny_config
from engine_setup import tiny_model as tiny_engine_model
from torch.distributed.tensor import DTensor
from verl.utils import tensordict_utils as tu
from verl.workers.utils.losses import sft_loss

SCALE = 0.3
BATCH = 8  # 2 ranks x 2 micro-batches of 2


def mtp_config():
    config = tiny_config()
    config.mtp_num_hidden_layers = 1
    return config


def write_mtp_model(path: str) -> str:
    vm.save_pretrained(tiny_engine_model(mtp_config(), seed=3), path)
    return path


def full_batch():
    """An SFT-style batch: a nested loss_mask per token (random targets, never a sequence's first token)."""
    data = make_batch(BATCH, 6, 7, seed=11)
    ids = data["input_ids"]
    gen = torch.Generator().manual_seed(5)
    mask = (torch.rand(ids.values().shape, generator=gen) < 0.6).to(torch.int64)
    mask[ids.offsets()[:-1].long()] = 0
    data["loss_mask"] = torch.nested.nested_tensor_from_jagged(mask, ids.offsets())
    return data


def reference(path: str) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, gradients by name) of plain autograd over the whole batch in one process."""
    model = vm.from_pretrained(path)
    data = full_batch()
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(data["loss_mask"].sum()))
    log_probs, _ = reference_log_probs(model, data)
    loss, _ = sft_loss(None, {"log_probs": log_probs}, data)
    depth = model.arch.mtp_num_hidden_layers
    sums, counts = [0.0] * depth, [0] * depth
    for ids, pos, mask in zip(data["input_ids"].unbind(), data["position_ids"].unbind(), data["loss_mask"].unbind()):
        L = ids.shape[0]
        hidden = model(ids[None], pos[None]).last_hidden_state
        depths = model.mtp_hidden_states(hidden, ids[None], pos[None])
        for k in range(1, depth + 1):
            # position t predicts token t+k+1 of the same sequence, counted where loss_mask marks it
            targets, valid = ids[k + 1 :], mask[k + 1 :].to(torch.bool)
            ce = F.cross_entropy(model.logits(depths[k - 1, 0, : L - k - 1]), targets, reduction="none")
            sums[k - 1] = sums[k - 1] + ce[valid].sum()
            counts[k - 1] += int(valid.sum())
    loss = loss + SCALE / depth * sum(s / c for s, c in zip(sums, counts))
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def mtp_settings(**fields):
    from verl.workers.config.model import MtpConfig

    return {"mtp": MtpConfig(**fields)}


def train_with_mtp(rank: int, world_size: int, path: str, backend: str) -> dict:
    model = mtp_settings(enable=True, enable_train=True, mtp_loss_scaling_factor=SCALE)
    if backend == "veomni":
        engine = dict(mixed_precision=True, param_dtype="fp32", use_dynamic_bsz=False, expert_parallel_size=2)
        engine = _new_engine("veomni", path, engine, None, None, model)
    else:
        engine = build_engine(path, model=model)
    local = rank_slice(full_batch(), rank, world_size)
    tu.assign_non_tensor(local, global_batch_size=BATCH, use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    with engine.train_mode():
        out = engine.forward_backward_batch(local, partial(sft_loss, None), forward_only=False)
        grads = {}
        for name, p in engine.module.model.named_parameters():
            grads[name] = None if p.grad is None else (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
        engine.optimizer_step()
    ref_loss, ref_grads = reference(path)
    errors = {
        name: ((g - ref_grads[name]).norm() / ref_grads[name].norm().clamp_min(1e-30)).item()
        for name, g in grads.items()
    }
    result = {
        "loss": sum(out["loss"]),
        "ref_loss": ref_loss,
        "mtp_loss": out["metrics"]["mtp_loss"],
        "worst_grad": max(errors.items(), key=lambda kv: kv[1]),
        "mtp_grads": sum(1 for n, g in grads.items() if n.startswith("mtp.") and g is not None and g.abs().sum() > 0),
    }
    # the trained MTP weights reach a rollout model of the same config through the weight sync
    from verl_moe.engines.rollout.weights import load_named_tensors

    rollout = vm.build(mtp_config())
    tensors, _ = engine.get_per_tensor_param()
    load_named_tensors(rollout, tensors)
    fc = engine.module.model.mtp.fc.weight
    result["rollout_fc_equal"] = torch.equal(rollout.mtp.fc.weight, fc.full_tensor() if isinstance(fc, DTensor) else fc)
    return result


@pytest.mark.dist
@pytest.mark.parametrize("backend", ["fsdp2", "veomni"])
def test_mtp_loss_matches_single_process_reference(tmp_path, backend):
    from forked import shared_server

    path = write_mtp_model(str(tmp_path / "model"))
    results = shared_server().run(__name__, "train_with_mtp", 2, path, backend, timeout=180).check()
    ref_loss = results[0]["ref_loss"]
    # each rank's micro-batch losses carry dp_size: their mean over ranks is the batch's loss
    engine_loss = sum(r["loss"] for r in results) / len(results)
    assert abs(engine_loss - ref_loss) <= 1e-5 * abs(ref_loss), (engine_loss, ref_loss)
    for r in results:
        name, err = r["worst_grad"]
        assert err < 1e-4, f"{name}: gradient rel error {err:.2e}"
        assert r["mtp_grads"] > 5 and r["rollout_fc_equal"]
        assert all(v > 0 for v in r["mtp_loss"])


def test_rl_batch_loss_mask_sits_on_the_response_tokens():
    """An RL batch's per-response loss_mask (padded [N, R], or nested [N, r_j] as main_ppo hands it) placed
    per token where verl's no_padding_2_padding reads the response (the log-prob of token s at index s - 1)."""
    from verl.workers.utils.padding import no_padding_2_padding
    from verl_moe.engines.mtp_loss import token_loss_mask

    data = make_batch(6, 5, 7, seed=2)
    data["loss_mask"] = data["loss_mask"] * (torch.rand(data["loss_mask"].shape) < 0.7)  # holes, as tool turns
    per_token = token_loss_mask(data)
    T = data["input_ids"].values().shape[0]
    token_of_column = no_padding_2_padding(torch.arange(T) + 1, data)  # [N, R] packed index of each response token
    valid = data["attention_mask"][:, data["prompts"].shape[1] :].bool()
    assert torch.equal(per_token[token_of_column[valid]], data["loss_mask"][valid])
    assert per_token.sum() == data["loss_mask"].sum()
    # main_ppo's form: the same rows nested [N, r_j]
    rows = [row[v] for row, v in zip(data["loss_mask"], valid)]
    data["loss_mask"] = torch.nested.nested_tensor(rows, layout=torch.jagged)
    assert torch.equal(token_loss_mask(data), per_token)


def test_mtp_configuration_errors(tmp_path):
    from verl_moe.engines.config import validate_engine_config
    from verl_moe.tools.align.backends.engine import engine_configs

    with_mtp = write_mtp_model(str(tmp_path / "mtp"))
    without = str(tmp_path / "plain")
    vm.save_pretrained(tiny_engine_model(), without)

    def check(path, world_size=1, engine=None, **mtp):
        engine = {"strategy": "fsdp2", **(engine or {})}
        model_config, engine_config, _ = engine_configs("fsdp2", path, engine, {"lr": 1e-3}, mtp_settings(**mtp))
        validate_engine_config(model_config, engine_config, world_size)
        return model_config

    # verl zeroes the MTP layers unless model.mtp.enable: the engine then builds and loads without them
    assert check(with_mtp).hf_config.mtp_num_hidden_layers == 0
    assert check(with_mtp, enable=True).hf_config.mtp_num_hidden_layers == 1
    check(with_mtp, enable=True, enable_train=True)
    with pytest.raises(ValueError, match=r"needs a config with MTP layers \(mtp_num_hidden_layers > 0\)"):
        check(without, enable=True)
    with pytest.raises(ValueError, match="enable_train=true needs model.mtp.enable=true"):
        check(with_mtp, enable_train=True)
    with pytest.raises(ValueError, match="must be finite and >= 0"):
        check(with_mtp, enable=True, enable_train=True, mtp_loss_scaling_factor=-1.0)
    sp = {"ulysses_sequence_parallel_size": 2}
    with pytest.raises(ValueError, match="not supported with sequence parallelism"):
        check(with_mtp, world_size=2, engine=sp, enable=True, enable_train=True)


def load_without_mtp(rank: int, world_size: int, path: str) -> dict:
    """verl's default (model.mtp off) on a checkpoint with MTP tensors: the engine builds and loads the
    model without them, exports none, a rollout of verl's config takes its weights, and our merger writes the
    checkpoint as an HF folder with the released folder's config (its MTP layers zeroed)."""
    from verl_moe.engines.rollout.weights import load_named_tensors

    engine = build_engine(path)
    names = [n for n, _ in engine.module.model.named_parameters()]
    tensors, _ = engine.get_per_tensor_param()
    exported = []
    rollout = vm.build(engine.model_config.hf_config)
    load_named_tensors(rollout, ((n, t) for n, t in tensors if not exported.append(n)))
    # verl's merger path: the checkpoint (no MTP tensors) merges with the released folder's config
    ckpt = os.path.join(os.path.dirname(path), "ckpt")
    engine.save_checkpoint(ckpt)
    merged = None
    if rank == 0:
        from verl_moe.engines.model_merger import merge

        merge(ckpt, os.path.join(os.path.dirname(path), "merged"), config_dir=path)
        merged = vm.from_pretrained(os.path.join(os.path.dirname(path), "merged")).arch.mtp_num_hidden_layers
    return {
        "mtp_params": sum(n.startswith("mtp.") for n in names),
        "mtp_exported": sum("mtp." in n for n in exported),
        "merged_mtp_layers": merged if rank == 0 else 0,
    }


@pytest.mark.dist
def test_mtp_off_loads_checkpoint_with_mtp_tensors(tmp_path):
    from forked import shared_server

    path = write_mtp_model(str(tmp_path / "model"))
    for result in shared_server().run(__name__, "load_without_mtp", 2, path, timeout=120).check():
        assert result == {"mtp_params": 0, "mtp_exported": 0, "merged_mtp_layers": 0}
