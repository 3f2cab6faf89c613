"""Rotary position embedding: plain RoPE (Qwen3-MoE), interleaved mRoPE with partial rotary (Qwen3.5).

The dispatched `rope` callable is `apply_rotary_pos_emb_ref`'s contract: `(q, k, cos, sin) -> (q, k)`.
"""

from ..dispatch import resolve
from .reference import apply_rotary_pos_emb_ref, mrope_rows, rope_cos_sin, rope_inv_freq

IMPLS = {
    "torch": "verl_moe.ops.rope.reference:apply_rotary_pos_emb_ref",
    "triton": "verl_moe.ops.rope.fused:apply_rotary_pos_emb_fused",
}


def apply_rotary_pos_emb(q, k, cos, sin, impl: str | None = None):
    """Rotate q and k through the implementation `resolve("rope", impl)` picks; arguments and
    returns as `apply_rotary_pos_emb_ref`."""
    return resolve("rope", impl)(q, k, cos, sin)


__all__ = ["IMPLS", "apply_rotary_pos_emb", "apply_rotary_pos_emb_ref", "mrope_rows", "rope_cos_sin", "rope_inv_freq"]
