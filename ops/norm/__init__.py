"""RMSNorm (plain, (1 + weight), and silu-gated, optionally fused with the residual add), the norms of
Qwen3.5-MoE and Qwen3-MoE.

The dispatched `norm` callable is `rms_norm_ref`'s contract: `(x, weight, eps, unit_offset=False,
gate=None, residual=None)`; with `residual` it returns `(norm(x + residual), x + residual)`.
"""

from __future__ import annotations

import torch

from ..dispatch import resolve
from .reference import rms_norm_ref

IMPLS = {
    "torch": "verl_moe.ops.norm.reference:rms_norm_ref",
    "triton": "verl_moe.ops.norm.fused:rms_norm",
    "exact": "verl_moe.ops.norm.exact:rms_norm_exact",
}


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    unit_offset: bool = False,
    residual: torch.Tensor | None = None,
    impl: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim. x: [..., D] any float dtype; weight: [D], used as (1 + weight)
    when unit_offset (Qwen3.5) else as weight (Qwen3-MoE). Normalisation in fp32, returns x.dtype.
    residual: optional [..., D] in x.dtype; then returns (norm(h), h) with h = x + residual in x.dtype.
    Raises ValueError on shape/dtype mismatch."""
    return resolve("norm", impl)(x, weight, eps, unit_offset=unit_offset, residual=residual)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, impl: str | None = None
) -> torch.Tensor:
    """norm(x) * weight * silu(gate), as transformers' `Qwen3_5MoeRMSNormGated`.
    x, gate: [..., D]; weight: [D]. Returns x.dtype. Raises ValueError on shape/dtype mismatch."""
    return resolve("norm", impl)(x, weight, eps, gate=gate)


__all__ = ["IMPLS", "gated_rms_norm", "rms_norm", "rms_norm_ref"]
