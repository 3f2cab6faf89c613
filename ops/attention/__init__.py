"""Causal grouped-query attention over packed sequences (Qwen3.5 / Qwen3-MoE full-attention layers).

The dispatched `attention` callable is `causal_attention_ref`'s contract.
"""

from ..dispatch import resolve
from .reference import causal_attention_ref

IMPLS = {"torch": "verl_moe.ops.attention.reference:causal_attention_ref"}


def causal_attention(q, k, v, scale=None, cu_seqlens=None, impl: str | None = None):
    """Causal attention through the implementation `resolve("attention", impl)` picks; arguments and
    returns as `causal_attention_ref`."""
    return resolve("attention", impl)(q, k, v, scale=scale, cu_seqlens=cu_seqlens)


__all__ = ["IMPLS", "causal_attention", "causal_attention_ref"]
