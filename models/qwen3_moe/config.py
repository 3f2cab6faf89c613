"""Qwen3-MoE: read transformers' `Qwen3MoeConfig` into an `ArchConfig`.

What transformers does that this mirrors: plain-weight RMSNorms; full attention in every layer
with q/k norm and full-width RoPE; MoE layers without a shared expert, except layers listed in
`mlp_only_layers` or off the `decoder_sparse_step` grid, which are dense MLPs of
`intermediate_size`; `norm_topk_prob` as configured.
"""

from __future__ import annotations

from ..arch import ArchConfig
from ..hf_config import check_common, head_dim, rope_parameters


def text_config(hf_config):
    """Qwen3-MoE is text-only: the config itself."""
    return hf_config


def arch_config(cfg) -> ArchConfig:
    """ArchConfig of a `qwen3_moe` config. Raises ValueError on what we do not support."""
    check_common(cfg)
    rope = rope_parameters(cfg)
    if cfg.use_sliding_window:
        raise ValueError("Qwen3-MoE with use_sliding_window=True is not supported (full causal attention only)")
    n = cfg.num_hidden_layers
    mlp_only = set(cfg.mlp_only_layers or [])
    if cfg.decoder_sparse_step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {cfg.decoder_sparse_step}")
    mlp_types = tuple(
        "moe" if i not in mlp_only and cfg.num_experts > 0 and (i + 1) % cfg.decoder_sparse_step == 0 else "dense"
        for i in range(n)
    )
    return ArchConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        rms_norm_eps=cfg.rms_norm_eps,
        layer_types=("full_attention",) * n,
        mlp_types=mlp_types,
        norm_unit_offset=False,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=head_dim(cfg),
        attention_bias=cfg.attention_bias,
        attn_output_gate=False,
        rope_theta=rope["rope_theta"],
        partial_rotary_factor=1.0,  # transformers' Qwen3-MoE rotates the whole head
        mrope_section=None,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size,
        norm_topk_prob=cfg.norm_topk_prob,
        shared_expert_intermediate_size=0,
        intermediate_size=cfg.intermediate_size if "dense" in mlp_types else 0,
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.initializer_range,
        pad_token_id=cfg.pad_token_id,
    )
