"""LoRA through both engines (verl's model_config.lora_rank / lora_alpha / target_modules / lora.merge).

fsdp2, adapters on attention, GatedDeltaNet and the routed experts, two GRPO steps, on 1 rank and on 2
gloo ranks: only adapter entries change, the merged export equals base + scale * B A (fp64 from the
exported base and adapters), `disable_adapter` gives the untrained model's log-probs back bitwise, the
unmerged export is the adapters under peft's names with a peft config, a checkpoint resumes bitwise;
1 rank and 2 ranks agree (summed loss, grad norms, adapters) within fp32 reduction-order tolerance.
veomni, expert LoRA, 2 ranks: EP=2 trains as EP=1. fsdp2, 2 ranks holding one batch: Ulysses SP 2 with
activation offload trains as data parallel without it (grad norms, adapters). Bad LoRA keys fail
validation naming them.

Tolerances: 2 ranks vs 1, fp32 (summation order only): losses and grad norms rel 1e-5, adapters rel RMS
1e-5; merged export vs fp64 base + scale * B A: rel RMS 1e-6.
"""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import verl_moe.models as vm
from engine_setup import (
    _new_engine,
    build_engine,
    fixed_ppo_batch,
    grpo_actor_config,
    ppo_loss_fn,
    tiny_config,
    write_tiny_model,
)
from verl.trainer.config import CheckpointConfig
from verl.utils import tensordict_utils as tu
from verl_moe.engines import export
from verl_moe.engines.config import MoeFsdp2EngineConfig, validate_engine_config
from verl_moe.models import lora
from verl_moe.ops.compare import assert_rel_rms, rel_rms

TARGETS = ["q_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj", "gate_up_proj", "down_proj"]


def _lora_model(merge: bool, targets=TARGETS) -> dict:
    return {"lora_rank": 4, "lora_alpha": 8, "target_modules": targets, "lora": {"merge": merge}}


def _steps(engine, rank: int, world_size: int, seeds) -> tuple[list, list]:
    losses, norms = [], []
    for seed in seeds:
        data = fixed_ppo_batch(8, 5, 6, seed=seed, rank=rank, world_size=world_size)
        tu.assign_non_tensor(data, micro_batch_size_per_gpu=len(data))  # one micro-batch: CPU time
        with engine.train_mode():
            out = engine.train_batch(data, ppo_loss_fn(grpo_actor_config()))
        engine.lr_scheduler_step()
        total = torch.tensor(sum(out["loss"]), dtype=torch.float64)
        dist.all_reduce(total)  # each micro-batch loss is its share of the global token mean, times dp size
        losses.append(total.item() / engine.get_data_parallel_size())
        norms.append(out["metrics"]["grad_norm"])
    return losses, norms


def _log_probs(engine, rank: int, world_size: int) -> list[float]:
    data = fixed_ppo_batch(8, 5, 6, seed=11, rank=rank, world_size=world_size)
    tu.assign_non_tensor(data, micro_batch_size_per_gpu=len(data))
    with engine.eval_mode():
        return engine.infer_batch(data)["model_output"]["log_probs"].values().tolist()


def _named(engine, **kwargs) -> tuple[dict, dict | None]:
    gen, peft_config = engine.get_per_tensor_param(layout="hf", **kwargs)
    return {name: t.detach().clone() for name, t in gen}, peft_config


def fsdp2_lora(rank: int, world_size: int, path: str, ckpt: str) -> dict:
    contents = ["model", "optimizer", "extra"]
    config = CheckpointConfig(save_contents=[*contents, "hf_model"], load_contents=contents)
    engine = build_engine(path, model=_lora_model(merge=True), checkpoint_config=config, micro_batch_size_per_gpu=4)
    model = engine.module.model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert {id(p) for g in engine.optimizer.param_groups for p in g["params"]} == {
        id(p) for p in model.parameters() if p.requires_grad
    }
    base0 = dict(export.full_named_tensors(model))
    log_probs0 = _log_probs(engine, rank, world_size)
    losses, norms = _steps(engine, rank, world_size, (3, 4))
    trained = {n: t.tolist() for n, t in export.adapter_named_tensors(model)}  # after the two compared steps
    if world_size == 1:  # one more step after a checkpoint, for the resume check
        merged_at_save = _named(engine)[0]
        engine.save_checkpoint(ckpt, global_step=2)
        resumed = _steps(engine, rank, world_size, (5,))

    base = dict(export.full_named_tensors(model))
    assert base.keys() == base0.keys() and all(torch.equal(base[k], base0[k]) for k in base)  # base frozen
    adapters = dict(export.adapter_named_tensors(model))
    assert all(t.abs().max() > 0 for n, t in adapters.items() if "lora_B" in n)  # B left zero: trained
    merged, peft_config = _named(engine)
    assert peft_config is None and merged.keys() == base.keys()
    state = model.state_dict()
    for name, (a, b, scale) in lora.adapted_weights(model).items():
        A, B = adapters[lora.peft_name(a)].double(), adapters[lora.peft_name(b)].double()
        assert A.shape == state[a].shape  # full tensors
        ref = base[name].double() + scale * torch.matmul(B, A)
        assert_rel_rms(name, ref, merged[name], 1e-6)
    with engine.disable_adapter():
        assert _log_probs(engine, rank, world_size) == log_probs0
    assert _log_probs(engine, rank, world_size) != log_probs0
    if world_size == 1:
        # the checkpoint's HF export is the merged model (as of the save: two steps)
        hf = vm.from_pretrained(os.path.join(ckpt, "huggingface")).state_dict()
        assert hf.keys() == set(merged) and all(torch.equal(hf[k], merged_at_save[k]) for k in hf)
        check_unmerged_resume(path, config, ckpt, base, adapters, resumed)
    return {"losses": losses, "norms": norms, "adapters": trained}


def check_unmerged_resume(path, config, ckpt, base, adapters, resumed) -> None:
    """The checkpoint after two steps, loaded into an engine with lora.merge False: the rollout's two
    unmerged exports (base alone with the peft config, then the adapters under peft's names), and the
    next step equal to the saving engine's (`resumed`: losses, norms; `adapters` after it) bit for bit."""
    # unmerged: verl's rollout sync first asks for the base (base_sync_done False), then the adapters
    unmerged = build_engine(path, model=_lora_model(merge=False), checkpoint_config=config, micro_batch_size_per_gpu=4)
    unmerged.load_checkpoint(ckpt)
    base_only, peft_config = _named(unmerged)
    assert peft_config["r"] == 4 and peft_config["lora_alpha"] == 8
    assert set(peft_config["target_modules"]) == set(TARGETS) - {"gate_up_proj"}  # down_proj: shared expert
    assert peft_config["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert all(torch.equal(base_only[k], base[k]) for k in base)
    peft_named, _ = _named(unmerged, base_sync_done=True)
    assert peft_named.keys() == adapters.keys() and all(k.startswith("base_model.model.") for k in peft_named)
    assert _steps(unmerged, 0, 1, (5,)) == resumed  # resume exact
    assert all(torch.equal(t, adapters[n]) for n, t in export.adapter_named_tensors(unmerged.module.model))


def _assert_trained_alike(one: dict, two: dict, keys, floor: float = 0.0) -> None:
    """The scalars under `keys` within rel 1e-5 (of max(|value|, floor)) and the adapters within rel RMS
    1e-5: fp32, two layouts of the same training differ in summation order only."""
    for key in keys:
        for a, b in zip(one[key], two[key], strict=True):
            assert abs(a - b) <= 1e-5 * max(abs(a), floor), (key, a, b)
    assert one["adapters"].keys() == two["adapters"].keys()
    for name, value in one["adapters"].items():
        assert rel_rms(torch.tensor(value), torch.tensor(two["adapters"][name])) <= 1e-5, name


@pytest.mark.dist
def test_fsdp2_lora_trains_adapters_only_and_two_ranks_equal_one(tmp_path):
    from forked import shared_server

    path = write_tiny_model(str(tmp_path / "model"))
    runs = {}
    for world_size in (1, 2):
        ckpt = str(tmp_path / f"ckpt{world_size}")
        outcome = shared_server().run(__name__, "fsdp2_lora", world_size, path, ckpt, timeout=180).check()
        runs[world_size] = outcome[0]
    _assert_trained_alike(runs[1], runs[2], ("losses", "norms"))


def veomni_expert_lora(rank: int, world_size: int, path: str) -> dict:
    out = {}
    for ep in (1, 2):
        engine_fields = dict(
            mixed_precision=True, param_dtype="fp32", use_dynamic_bsz=False, micro_batch_size_per_gpu=2,
            infer_micro_batch_size_per_gpu=2, expert_parallel_size=ep,
        )  # fmt: skip
        model = _lora_model(merge=True, targets=["gate_up_proj", "down_proj", "q_proj"])
        engine = _new_engine("veomni", path, engine_fields, None, None, model)
        trainable = [n for n, p in engine.module.model.named_parameters() if p.requires_grad]
        assert trainable and all("lora_" in n for n in trainable), trainable  # base experts frozen under EP too
        if ep == 2:
            local = engine.module.model.model.layers[0].mlp.experts.gate_up_proj_lora_A.to_local()
            assert local.shape[0] == 2  # 4 experts over 2 ranks, as the expert weights
        losses, norms = _steps(engine, rank, world_size, (3, 4))
        adapters = {n: t.tolist() for n, t in export.adapter_named_tensors(engine.module.model)}
        merged, _ = _named(engine)
        out[ep] = {
            "losses": losses,
            "norms": norms,
            "adapters": adapters,
            "merged_sum": [float(t.double().sum()) for t in merged.values()],
        }
    return out


@pytest.mark.dist
def test_veomni_expert_lora_ep2_equals_ep1(tmp_path):
    from forked import shared_server

    path = write_tiny_model(str(tmp_path / "model"))
    result = shared_server().run(__name__, "veomni_expert_lora", 2, path, timeout=180).check()[0]
    assert any("experts.gate_up_proj.lora_B" in n for n in result["1"]["adapters"])
    _assert_trained_alike(result["1"], result["2"], ("losses", "norms", "merged_sum"), floor=1.0)


def fsdp2_lora_sp_offload(rank: int, world_size: int, path: str) -> dict:
    """Two GRPO steps of LoRA on 2 ranks holding the same batch: data parallel without offload, then
    Ulysses SP 2 with activation offload (its units inside the layers). Both see the same global batch."""
    out = {}
    for name, fields, model in (
        ("dp", {}, {}),
        ("sp_offload", {"ulysses_sequence_parallel_size": 2}, {"enable_activation_offload": True}),
    ):
        engine = build_engine(path, model={**_lora_model(merge=True), **model}, **fields)
        norms = []
        for seed in (3, 4):
            data = fixed_ppo_batch(8, 5, 6, seed=seed, rank=0, world_size=1)  # the whole batch on each rank
            tu.assign_non_tensor(data, micro_batch_size_per_gpu=len(data))
            with engine.train_mode():
                norms.append(engine.train_batch(data, ppo_loss_fn(grpo_actor_config()))["metrics"]["grad_norm"])
            engine.lr_scheduler_step()
        assert (engine.activation_offload is not None) == (name == "sp_offload")
        assert name == "dp" or engine.activation_offload.packed_tensors > 0
        adapters = {n: t.tolist() for n, t in export.adapter_named_tensors(engine.module.model)}
        out[name] = {"norms": norms, "adapters": adapters}
    return out


@pytest.mark.dist
def test_fsdp2_lora_under_sp_and_activation_offload_trains_as_data_parallel(tmp_path):
    from forked import shared_server

    path = write_tiny_model(str(tmp_path / "model"))
    result = shared_server().run(__name__, "fsdp2_lora_sp_offload", 2, path, timeout=180).check()[0]
    _assert_trained_alike(result["dp"], result["sp_offload"], ("norms",))


def _model_config(**keys):
    fields = dict(hf_config=tiny_config(), lora_rank=0, lora_alpha=16, target_modules="all-linear",
                  target_parameters=None, exclude_modules=None, lora_adapter_path=None, lora={},
                  enable_activation_offload=False)  # fmt: skip
    return SimpleNamespace(**{**fields, **keys})


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (dict(lora_rank=-2), "lora_rank=-2 must be >= 0"),
        (dict(lora_rank=4, target_modules=["q_proj", "w_qkv"]), "LoRA target 'w_qkv' matches no module"),
        (dict(lora_rank=4, target_parameters=["mlp.experts.up_proj"]), "LoRA target 'mlp.experts.up_proj'"),
        (dict(lora_rank=4, lora_adapter_path="/adapter"), "lora_adapter_path is not supported"),
    ],
)
def test_bad_lora_keys_raise_naming_them(keys, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_engine_config(_model_config(**keys), MoeFsdp2EngineConfig(), 2)


def test_lora_in_exact_mode_is_refused_naming_both():
    """The adapters' matmuls (`models/lora.py`) are torch's GEMMs, not exact forms: exact mode would not hold."""
    engine_config = MoeFsdp2EngineConfig(ops=vm.OpsConfig(exact=True))
    message = "LoRA (model.lora_rank=8) cannot run in exact mode (ops.exact=true)"
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_engine_config(_model_config(lora_rank=8), engine_config, 2)
    validate_engine_config(_model_config(), engine_config, 2)


def test_lora_keys_pass_validation():
    validate_engine_config(_model_config(lora_rank=8), MoeFsdp2EngineConfig(), 2)
    validate_engine_config(_model_config(lora_rank=8, target_modules=TARGETS, exclude_modules=".*layers\\.0\\..*"),
                           MoeFsdp2EngineConfig(), 2)  # fmt: skip
