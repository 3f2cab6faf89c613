"""Causal grouped-query attention over packed sequences (Qwen3.5 / Qwen3-MoE full-attention layers)."""

from .reference import causal_attention_ref

IMPLS = {"torch": "verl_moe.ops.attention.reference:causal_attention_ref"}

# The public op is the reference until a kernel exists; it validates before computing.
causal_attention = causal_attention_ref

__all__ = ["IMPLS", "causal_attention", "causal_attention_ref"]
