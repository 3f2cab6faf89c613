"""The registry: supported model types, the VL config's text part, and config validation that
happens before any parameter is allocated."""

import pytest
import torch
import verl_moe.models as vm
from tiny_models import tiny_qwen3_5_moe_text, tiny_qwen3_5_moe_vl, tiny_qwen3_moe


def test_supported_model_types():
    assert vm.get_spec("qwen3_5_moe_text").family == vm.get_spec("qwen3_5_moe").family == "qwen3_5_moe"
    assert vm.get_spec("qwen3_5_moe_text").vision_arch is None and vm.get_spec("qwen3_5_moe").vision_arch is not None
    assert vm.get_spec("qwen3_moe").family == "qwen3_moe"
    with pytest.raises(ValueError, match=r"supported: \['qwen3_5_moe', 'qwen3_5_moe_text', 'qwen3_moe'\]"):
        vm.get_spec("llama")


def test_vl_config_builds_the_vision_language_model():
    text, vl = vm.build(tiny_qwen3_5_moe_text()), vm.build(tiny_qwen3_5_moe_vl())
    assert isinstance(vl, vm.MoeVisionLM) and vl.config.model_type == "qwen3_5_moe"
    language = {
        k.replace("model.language_model.", "model."): v.shape
        for k, v in vl.state_dict().items()
        if not k.startswith("model.visual.")
    }
    assert language == {k: v.shape for k, v in text.state_dict().items()}
    names = set(text.state_dict())
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.linear_attn.in_proj_qkv.weight",
        "model.layers.2.self_attn.q_proj.weight",
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.shared_expert.up_proj.weight",
        "model.layers.0.mlp.shared_expert_gate.weight",
        "lm_head.weight",
    ):
        assert name in names, name


def test_layer_structure_follows_config():
    model = vm.build(tiny_qwen3_5_moe_text(num_hidden_layers=4, layer_types=None, full_attention_interval=2))
    kinds = ["linear_attn" if hasattr(layer, "linear_attn") else "self_attn" for layer in model.model.layers]
    assert kinds == ["linear_attn", "self_attn", "linear_attn", "self_attn"]
    assert isinstance(model.model.layers, torch.nn.ModuleList)


def test_invalid_configs_fail_before_allocation():
    """A huge model with one bad field raises at once instead of allocating ~1e12 parameters."""
    huge = dict(vocab_size=10**9, hidden_size=10**6)
    with pytest.raises(ValueError, match="linear_num_value_heads=6 must be a multiple"):
        vm.build(tiny_qwen3_5_moe_text(linear_num_key_heads=4, linear_num_value_heads=6, **huge))
    with pytest.raises(ValueError, match="hidden_act"):
        vm.build(tiny_qwen3_moe(hidden_act="gelu", **huge))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        vm.build(tiny_qwen3_moe(num_experts_per_tok=9, **huge))
    with pytest.raises(ValueError, match="norm_topk_prob"):
        vm.build(tiny_qwen3_5_moe_text(norm_topk_prob=False, **huge))


def test_meta_build_allocates_nothing():
    model = vm.build(tiny_qwen3_5_moe_text(), device="meta")
    assert all(p.is_meta for p in model.parameters())
