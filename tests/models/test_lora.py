"""models/lora.py: LoRA adapters on attention, GatedDeltaNet and the fused routed experts.

Tolerances (relative RMS error): the LoRA forward vs the merged dense model, both fp32: 1e-5
(the same math, factored vs merged: fp32 rounding only); `merge_weight` in fp32 vs an fp64 einsum of
base + scale * B A: 1e-6.
"""

from __future__ import annotations

import re

import pytest
import torch
import verl_moe.models as vm
from tiny_models import inputs, randomize_norms, tiny_qwen3_5_moe_text
from verl_moe.models import lora
from verl_moe.ops.compare import assert_rel_rms

ALL_TARGETS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
    "gate_up_proj", "down_proj",
)  # fmt: skip


def _adapted(dtype=torch.float32, targets=ALL_TARGETS, seed=0):
    """(base model, LoRA copy with random B) of the tiny Qwen3.5-MoE in `dtype`."""
    torch.manual_seed(seed)
    base = vm.build(tiny_qwen3_5_moe_text(), dtype=dtype)
    randomize_norms(base)
    model = vm.build(tiny_qwen3_5_moe_text(), dtype=dtype)
    model.load_state_dict(base.state_dict())
    settings = lora.LoraSettings(rank=4, alpha=8, target_modules=targets)
    lora.apply_lora(model, settings, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        gen = torch.Generator().manual_seed(2)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=dtype))
    return base, model


def test_targets_cover_attention_gdn_and_experts():
    _, model = _adapted()
    kinds = {type(m).__name__ for _, m in lora.lora_modules(model)}
    assert kinds == {"LoraLinear", "LoraExperts"}
    adapted = lora.adapted_weights(model)
    # 2 GDN layers x 5 projections, 1 attention layer x 4, shared expert down_proj x 3, experts x 2 weights x 3
    counts = {"in_proj_qkv.weight": 2, "out_proj.weight": 2, "q_proj.weight": 1, "experts.gate_up_proj": 3}
    for leaf, count in counts.items():
        assert sum(n.endswith(leaf) for n in adapted) == count, leaf
    assert sum(n.endswith("shared_expert.down_proj.weight") for n in adapted) == 3
    a, b, scale = adapted["model.layers.0.mlp.experts.gate_up_proj"]
    state = model.state_dict()
    assert state[a].shape == (4, 4, 64) and state[b].shape == (4, 64, 4) and scale == 2.0  # E, r, D / E, 2I, r


def test_only_adapters_train():
    _, model = _adapted(torch.float32)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(lora.is_adapter_key(n) for n in trainable)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ids, pos = inputs(2, 12)
    model(ids, pos).last_hidden_state.square().mean().backward()
    opt.step()
    for name, p in model.named_parameters():
        changed = not torch.equal(before[name], p.detach())
        assert changed == (name in trainable), name


def test_zero_b_is_the_base_model_and_disable_gives_it_back():
    torch.manual_seed(0)
    base = vm.build(tiny_qwen3_5_moe_text())
    model = vm.build(tiny_qwen3_5_moe_text())
    model.load_state_dict(base.state_dict())
    lora.apply_lora(model, lora.LoraSettings(rank=2, alpha=4, target_modules=ALL_TARGETS))
    ids, pos = inputs(2, 10)
    ref = base(ids, pos).last_hidden_state
    assert torch.equal(model(ids, pos).last_hidden_state, ref)  # B = 0 as peft: the base model
    _, trained = _adapted()
    trained_ref = vm.build(tiny_qwen3_5_moe_text())
    trained_ref.load_state_dict({k: v for k, v in trained.state_dict().items() if not lora.is_adapter_key(k)})
    with lora.adapters_disabled(trained):
        assert torch.equal(trained(ids, pos).last_hidden_state, trained_ref(ids, pos).last_hidden_state)
    assert not torch.equal(trained(ids, pos).last_hidden_state, trained_ref(ids, pos).last_hidden_state)


def test_merged_state_is_base_plus_scaled_ba_in_fp64():
    _, model = _adapted(torch.float32)
    state = model.state_dict()
    merged = lora.merged_state_dict(model, state)
    assert set(merged) == set(vm.build(tiny_qwen3_5_moe_text(), device="meta").state_dict())
    adapted = lora.adapted_weights(model)
    for name, (a, b, scale) in adapted.items():
        w, A, B = state[name].double(), state[a].double(), state[b].double()
        ref = w + scale * (torch.einsum("or,ri->oi", B, A) if w.dim() == 2 else torch.einsum("eor,eri->eoi", B, A))
        assert merged[name].dtype == torch.float32
        assert_rel_rms(name, ref, merged[name], 1e-6)
        assert not torch.allclose(merged[name].double(), w)
    for name in set(merged) - set(adapted):
        assert merged[name] is state[name]


def test_lora_forward_equals_merged_dense_model():
    _, model = _adapted()
    dense = vm.build(tiny_qwen3_5_moe_text())
    dense.load_state_dict(lora.merged_state_dict(model, model.state_dict()))
    ids, pos = inputs(2, 16)
    assert_rel_rms("hidden", dense(ids, pos).last_hidden_state, model(ids, pos).last_hidden_state, 1e-5)


def test_peft_names_and_config():
    _, model = _adapted(torch.float32, targets=("q_proj", "gate_up_proj"))
    names = sorted(lora.peft_name(n) for n in model.state_dict() if lora.is_adapter_key(n))
    assert "base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight" in names
    assert "base_model.model.model.layers.0.mlp.experts.gate_up_proj.lora_B.weight" in names
    config = lora.peft_config_dict(lora.LoraSettings(rank=4, alpha=8), model)
    assert config["r"] == 4 and config["lora_alpha"] == 8 and set(config["target_modules"]) == {"q_proj"}
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj"]


def test_all_linear_takes_every_decoder_linear_not_the_routed_experts():
    model = vm.build(tiny_qwen3_5_moe_text(), device="meta")
    linears, experts = lora.resolve_targets(model, lora.LoraSettings(rank=2, alpha=2))
    assert experts == [] and linears == lora.lora_candidates(model)[0]
    assert not any("embed" in n or "lm_head" in n or n.endswith("mlp.gate") for n in linears)
    linears, _ = lora.resolve_targets(model, lora.LoraSettings(rank=2, alpha=2, exclude_modules=r".*shared_expert.*"))
    assert linears and not any("shared_expert" in n for n in linears)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(rank=0, alpha=8), "lora_rank=0"),
        (dict(rank=-1, alpha=8), "lora_rank=-1"),
        (dict(rank=2, alpha=8, target_modules=("q_proj", "qkv_proj")), "LoRA target 'qkv_proj' matches no module"),
        (dict(rank=2, alpha=8, target_modules=("q_proj",), exclude_modules=("q_proj",)), "leaves no target"),
    ],
)
def test_bad_settings_raise_naming_them(settings, message):
    model = vm.build(tiny_qwen3_5_moe_text(), device="meta")
    with pytest.raises(ValueError, match=re.escape(message)):
        lora.apply_lora(model, lora.LoraSettings(**settings))
