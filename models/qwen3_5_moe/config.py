"""Qwen3.5-MoE: read transformers' `Qwen3_5MoeTextConfig` into an `ArchConfig` and, for the
vision-language `Qwen3_5MoeConfig`, its vision_config into a `VisionArch`.

What transformers does that this mirrors: RMSNorms use (1 + weight); attention has a sigmoid
output gate; rotary is interleaved mRoPE on the first `partial_rotary_factor` of each head
(rope_parameters' `mrope_section`, default [11, 11, 10]); every layer is MoE with a gated
shared expert; the router always renormalises its top-k (transformers ignores `norm_topk_prob`).
Beyond transformers: `mtp_num_hidden_layers` (config.json carries it, transformers' class does not read it)
gives the multi-token-prediction layers its model drops (docs/mtp.md).
"""

from __future__ import annotations

from ..arch import ArchConfig
from ..hf_config import check_common, rope_parameters
from .vision import VisionArch


def text_config(hf_config):
    """The text part: `hf_config.text_config` for the vision-language `qwen3_5_moe`, else itself."""
    if hf_config.model_type != "qwen3_5_moe":
        return hf_config
    text = hf_config.text_config
    if bool(hf_config.tie_word_embeddings) != bool(text.tie_word_embeddings):
        raise ValueError(
            f"qwen3_5_moe config: tie_word_embeddings={hf_config.tie_word_embeddings} but "
            f"text_config.tie_word_embeddings={text.tie_word_embeddings}; make them agree"
        )
    return text


def arch_config(cfg) -> ArchConfig:
    """ArchConfig of a `qwen3_5_moe_text` config. Raises ValueError on what we do not support."""
    check_common(cfg)
    rope = rope_parameters(cfg)
    if getattr(cfg, "norm_topk_prob", True) is False:
        raise ValueError(
            "Qwen3.5-MoE always renormalises the top-k router probabilities (transformers ignores "
            "norm_topk_prob); the config says norm_topk_prob=False"
        )
    n = cfg.num_hidden_layers
    if getattr(cfg, "mtp_use_dedicated_embeddings", False):
        raise ValueError("mtp_use_dedicated_embeddings=True is not supported (the MTP layer shares the embedding)")
    if cfg.layer_types is None or len(cfg.layer_types) != n:
        raise ValueError(f"layer_types must list {n} layers, got {cfg.layer_types}")
    return ArchConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        rms_norm_eps=cfg.rms_norm_eps,
        layer_types=tuple(cfg.layer_types),
        mlp_types=("moe",) * n,
        norm_unit_offset=True,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        attention_bias=cfg.attention_bias,
        attn_output_gate=True,
        rope_theta=rope["rope_theta"],
        partial_rotary_factor=rope.get("partial_rotary_factor", 1.0),
        mrope_section=tuple(rope.get("mrope_section", (11, 11, 10))),
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size,
        norm_topk_prob=True,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
        intermediate_size=0,
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.initializer_range,
        pad_token_id=cfg.pad_token_id,
        linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads,
        linear_key_head_dim=cfg.linear_key_head_dim,
        linear_value_head_dim=cfg.linear_value_head_dim,
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
        # not a field of transformers' config class: config.json carries it and transformers keeps it
        mtp_num_hidden_layers=getattr(cfg, "mtp_num_hidden_layers", 0) or 0,
    )


def vision_arch(hf_config) -> VisionArch:
    """VisionArch of a vision-language `qwen3_5_moe` config (its vision_config and placeholder ids).
    Raises ValueError on what we do not support, or a merger width other than the text hidden size."""
    vision = getattr(hf_config, "vision_config", None)
    if vision is None:
        raise ValueError("qwen3_5_moe config has no vision_config")
    for name in ("patch_size", "temporal_patch_size"):
        if not isinstance(getattr(vision, name), int):
            raise ValueError(f"vision_config.{name} must be one int, got {getattr(vision, name)!r}")
    text_hidden = hf_config.text_config.hidden_size
    if vision.out_hidden_size != text_hidden:
        raise ValueError(
            f"vision_config.out_hidden_size={vision.out_hidden_size} must equal text_config.hidden_size={text_hidden} "
            "(image features replace token embeddings)"
        )
    return VisionArch(
        depth=vision.depth,
        hidden_size=vision.hidden_size,
        intermediate_size=vision.intermediate_size,
        num_heads=vision.num_heads,
        in_channels=vision.in_channels,
        patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size,
        spatial_merge_size=vision.spatial_merge_size,
        out_hidden_size=vision.out_hidden_size,
        num_position_embeddings=vision.num_position_embeddings,
        hidden_act=vision.hidden_act,
        initializer_range=vision.initializer_range,
        image_token_id=hf_config.image_token_id,
        video_token_id=hf_config.video_token_id,
    )
