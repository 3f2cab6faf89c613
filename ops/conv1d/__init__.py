"""Depthwise causal conv1d + SiLU over packed sequences (Qwen3.5 GatedDeltaNet's short conv)."""

from .reference import causal_conv1d_ref

IMPLS = {"torch": "verl_moe.ops.conv1d.reference:causal_conv1d_ref"}

# The public op is the reference until a kernel exists; it validates before computing.
causal_conv1d = causal_conv1d_ref

__all__ = ["IMPLS", "causal_conv1d", "causal_conv1d_ref"]
