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


def mtp_checkpoint_tensors(config, num_layers: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random MTP tensors of a Qwen3.5-MoE text `config` under the names and shapes real checkpoints
    store them (vLLM's Qwen3.5 MTP loader reads these): `mtp.{fc, pre_fc_norm_embedding,
    pre_fc_norm_hidden, norm}` and per layer a full-attention decoder layer with experts per expert."""
    gen = torch.Generator().manual_seed(seed)
    D, H, HKV, K = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    E, I, IS = config.num_experts, config.moe_intermediate_size, config.shared_expert_intermediate_size
    shapes = {"mtp.fc.weight": (D, 2 * D)}
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        shapes[f"mtp.{norm}.weight"] = (D,)
    for k in range(num_layers):
        p = f"mtp.layers.{k}"
        shapes |= {
            f"{p}.input_layernorm.weight": (D,),
            f"{p}.post_attention_layernorm.weight": (D,),
            f"{p}.self_attn.q_proj.weight": (2 * H * K, D),  # query and output gate
            f"{p}.self_attn.k_proj.weight": (HKV * K, D),
            f"{p}.self_attn.v_proj.weight": (HKV * K, D),
            f"{p}.self_attn.o_proj.weight": (D, H * K),
            f"{p}.self_attn.q_norm.weight": (K,),
            f"{p}.self_attn.k_norm.weight": (K,),
            f"{p}.mlp.gate.weight": (E, D),
            f"{p}.mlp.shared_expert.gate_proj.weight": (IS, D),
            f"{p}.mlp.shared_expert.up_proj.weight": (IS, D),
            f"{p}.mlp.shared_expert.down_proj.weight": (D, IS),
            f"{p}.mlp.shared_expert_gate.weight": (1, D),
        }
        for e in range(E):
            q = f"{p}.mlp.experts.{e}"
            shapes |= {f"{q}.gate_proj.weight": (I, D), f"{q}.up_proj.weight": (I, D), f"{q}.down_proj.weight": (D, I)}
    # norms are (1 + w) in Qwen3.5: small values around 0; projections at the config's init scale
    return {
        name: torch.randn(shape, generator=gen) * (0.1 if len(shape) == 1 else config.initializer_range * 4)
        for name, shape in shapes.items()
    }


def save_checkpoint_with_mtp(config, folder, num_layers: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    """A tiny Qwen3.5-MoE checkpoint as released ones are: transformers' save of its model (which has no
    MTP module) plus `mtp_checkpoint_tensors` in a second shard and `mtp_num_hidden_layers` in config.json.
    Returns the MTP tensors written."""
    import json

    from safetensors.torch import save_file
    from transformers import Qwen3_5MoeForCausalLM

    torch.manual_seed(seed)
    Qwen3_5MoeForCausalLM(config).save_pretrained(folder)
    main_file = folder / "model.safetensors"
    with safe_open(str(main_file), "pt") as f:
        main = {k: f.get_tensor(k) for k in f.keys()}
    main_file.unlink()
    mtp = mtp_checkpoint_tensors(config, num_layers, seed)
    shards = {"model-00001-of-00002.safetensors": main, "model-00002-of-00002.safetensors": mtp}
    for file, tensors in shards.items():
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
    weight_map = {key: file for file, tensors in shards.items() for key in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    raw = json.loads((folder / "config.json").read_text())
    raw["mtp_num_hidden_layers"] = num_layers
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    return mtp


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
