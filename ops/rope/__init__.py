"""Rotary position embedding: plain RoPE (Qwen3-MoE), interleaved mRoPE with partial rotary (Qwen3.5)."""

from .reference import apply_rotary_pos_emb_ref, mrope_rows, rope_cos_sin, rope_inv_freq

IMPLS = {"torch": "verl_moe.ops.rope.reference:apply_rotary_pos_emb_ref"}

# The public rotation is the reference until a kernel exists; it validates before computing.
apply_rotary_pos_emb = apply_rotary_pos_emb_ref

__all__ = ["IMPLS", "apply_rotary_pos_emb", "apply_rotary_pos_emb_ref", "mrope_rows", "rope_cos_sin", "rope_inv_freq"]
