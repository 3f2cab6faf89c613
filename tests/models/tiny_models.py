"""Tiny Qwen3.5-MoE / Qwen3-MoE configs and helpers shared by the model tests (import as `tiny_models`)."""

from __future__ import annotations

import torch
import verl_moe.models as vm
from safetensors import safe_open
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig, Qwen3MoeConfig


def tiny_qwen3_5_moe_text(**overrides) -> Qwen3_5MoeTextConfig:
    """2 GatedDeltaNet layers + 1 attention layer, 4 experts top-2, GVA ratio 2, partial mRoPE."""
    kwargs = dict(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=3,
        layer_types=["linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        rms_norm_eps=1e-6,
        pad_token_id=0,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
    )
    kwargs.update(overrides)
    return Qwen3_5MoeTextConfig(**kwargs)


def tiny_qwen3_5_moe_vl(**overrides) -> Qwen3_5MoeConfig:
    """The vision-language config around the tiny text config (tiny vision tower)."""
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=4,
        num_position_embeddings=16,
    )
    return Qwen3_5MoeConfig(text_config=tiny_qwen3_5_moe_text(**overrides).to_dict(), vision_config=vision)


def tiny_qwen3_moe(**overrides) -> Qwen3MoeConfig:
    """3 attention layers (the middle one dense via mlp_only_layers), 4 experts top-2, GQA ratio 2."""
    kwargs = dict(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        rms_norm_eps=1e-6,
        pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    kwargs.update(overrides)
    return Qwen3MoeConfig(**kwargs)


def hf_causal_lm(config, model: vm.MoeCausalLM) -> torch.nn.Module:
    """transformers' eager `...ForCausalLM` for `config`, holding `model`'s weights (strict load)."""
    import transformers

    cls = getattr(transformers, model.spec.hf_causal_lm)
    config._attn_implementation = "eager"
    hf = cls(config).to(torch.float32).eval()
    hf.load_state_dict(model.state_dict(), strict=True)
    return hf


def randomize_norms(model: torch.nn.Module, seed: int = 1) -> None:
    """Fresh norms are the identity scale; give them random values so the tests see the weights."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (0.0 if p.mean() == 0 else 1.0))


def inputs(B: int, T: int, vocab: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=gen)
    return ids, torch.arange(T).expand(B, T).contiguous()


def packed_inputs(lengths, vocab: int = 128, seed: int = 0):
    """B == 1 packed ids, restarting positions, cu_seqlens int32."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return ids, pos, cu


def assert_matches_transformers(
    config, B: int = 2, T: int = 12, logit_tol: float = 1e-4, grad_tol: float = 1e-4
) -> None:
    """Our model and transformers' eager model with the same weights: max |d logit| <= logit_tol and,
    for a cross-entropy loss on the logits, per-parameter ||d grad|| / ||grad|| <= grad_tol."""
    model = vm.build(config)
    randomize_norms(model)
    hf = hf_causal_lm(config, model)
    ids, pos = inputs(B, T)
    targets = inputs(B, T, seed=1)[0]
    logits = model.logits(model(ids, pos).last_hidden_state)
    hf_logits = hf(input_ids=ids, position_ids=pos).logits
    diff = (logits - hf_logits).abs().max().item()
    assert diff <= logit_tol, f"max |d logit| {diff:.3e}"
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    torch.nn.functional.cross_entropy(hf_logits.flatten(0, 1), targets.flatten()).backward()
    hf_params = dict(hf.named_parameters())
    for name, p in model.named_parameters():
        g, g_hf = p.grad, hf_params[name].grad
        assert g is not None and g_hf is not None, name
        err = (g - g_hf).norm().item()
        assert err <= grad_tol * g_hf.norm().item() + 1e-12, f"{name}: |d grad| {err:.3e} vs |grad| {g_hf.norm():.3e}"


def assert_same_state(a: dict, b: dict) -> None:
    """Same names, dtypes and values, bit for bit."""
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def saved_keys(folder) -> set:
    """The tensor names of every safetensors file in `folder`."""
    keys = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            keys |= set(fh.keys())
    return keys
