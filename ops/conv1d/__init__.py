"""Depthwise causal conv1d + SiLU over packed sequences (Qwen3.5 GatedDeltaNet's short conv).

The dispatched `conv1d` callable is `causal_conv1d_ref`'s contract.
"""

from ..dispatch import resolve
from .reference import causal_conv1d_ref

IMPLS = {
    "torch": "verl_moe.ops.conv1d.reference:causal_conv1d_ref",
    "triton": "verl_moe.ops.conv1d.conv:causal_conv1d",
    "exact": "verl_moe.ops.conv1d.exact:causal_conv1d_exact",
}


def causal_conv1d(
    x, weight, bias=None, activation="silu", cu_seqlens=None, cu_seqlens_cpu=None, impl: str | None = None
):
    """Depthwise causal conv1d through the implementation `resolve("conv1d", impl)` picks; arguments
    and returns as `causal_conv1d_ref`."""
    return resolve("conv1d", impl)(
        x, weight, bias, activation=activation, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu
    )


__all__ = ["IMPLS", "causal_conv1d", "causal_conv1d_ref"]
