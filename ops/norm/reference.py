"""Plain PyTorch RMSNorm references, numerically equal to transformers' Qwen3.5-MoE / Qwen3-MoE norms.

Two weight conventions exist and each rounds at a different point in low precision, so both
are reproduced exactly:

- unit offset (Qwen3.5): `y = (x_hat * (1 + w)).to(x.dtype)`, everything in fp32 until the end.
- plain (Qwen3-MoE): `y = w * x_hat.to(x.dtype)`: the normalised input is rounded to x.dtype
  before the weight multiplies it (transformers' Llama-style order).
- gated (Qwen3.5 GatedDeltaNet output): `y = ((w * x_hat.to(x.dtype)).float() * silu(gate.float()))
  .to(x.dtype)`, as `Qwen3_5MoeRMSNormGated` computes it.
- residual: `h = x + residual` in x.dtype (the decoder layer's `hidden = hidden + x`), then the norm
  of h; returns `(norm(h), h)`.

x_hat = x * rsqrt(mean(x^2) + eps) is computed in fp32 (fp64 for fp64 inputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def check_norm_inputs(
    x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None, residual: torch.Tensor | None = None
) -> None:
    """Raise ValueError unless x is a float [..., D], weight is [D], gate (if any) has x's shape and
    residual (if any) has x's shape and dtype."""
    if not x.is_floating_point() or not weight.is_floating_point():
        raise ValueError(f"rms_norm needs floating point x and weight, got {x.dtype} and {weight.dtype}")
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rms_norm: weight must be [D] with D = x.shape[-1]; got x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gated rms_norm: gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"rms_norm: residual must have x's shape {tuple(x.shape)} and dtype {x.dtype}, "
            f"got {tuple(residual.shape)} {residual.dtype}"
        )


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    unit_offset: bool = False,
    gate: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, optionally gated by silu(gate), optionally of x + residual (the
    dispatched `norm` op).

    Args:
        x: [..., D] any float dtype.
        weight: [D]; multiplies as (1 + weight) when unit_offset (Qwen3.5), else as weight.
        eps: added to mean(x^2).
        unit_offset: Qwen3.5's (1 + weight) convention; cannot be combined with gate.
        gate: optional [..., D]; output is multiplied by silu(gate) (Qwen3.5 GatedDeltaNet norm).
        residual: optional [..., D] in x.dtype; the norm is taken of h = x + residual (added in x.dtype).
    Returns:
        [..., D] in x.dtype; with residual the tuple (norm(h), h), both [..., D] in x.dtype.
    Raises:
        ValueError: shape or dtype mismatch, or unit_offset together with gate.
    """
    check_norm_inputs(x, weight, gate, residual)
    if gate is not None and unit_offset:
        raise ValueError("gated rms_norm uses the plain weight convention; unit_offset=True is not defined")
    if residual is not None:
        h = x + residual
        return rms_norm_ref(h, weight, eps, unit_offset, gate), h
    cd = _compute_dtype(x)
    xf = x.to(cd)
    x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (x_hat * (1.0 + weight.to(cd))).to(x.dtype)
    y = weight * x_hat.to(x.dtype)
    if gate is not None:
        y = y.to(cd) * F.silu(gate.to(cd))
    return y.to(x.dtype)
