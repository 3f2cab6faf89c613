"""Routed MoE expert MLPs over transformers' fused [E, 2I, D] / [E, D, I] weights."""

from .reference import moe_experts_ref

IMPLS = {"torch": "verl_moe.ops.experts.reference:moe_experts_ref"}

# The public op is the reference until a kernel exists; it validates before computing.
moe_experts = moe_experts_ref

__all__ = ["IMPLS", "moe_experts", "moe_experts_ref"]
