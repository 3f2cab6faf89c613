"""The batch-invariant projection of exact mode: in PyTorch here (the CPU form), in Triton on devices
(`exact_kernel.py`).

A GEMM library picks its blocking (and its order of summation over K) by the shape of the call, so
one row's result changes with how many rows share it: a decode step of 16 rows and a packed forward
of 2,000 round differently. Here every output is accumulated over K in one fixed order, k = 0, 1, ...,
by separate elementwise multiplies and adds (no fused multiply-add, no reduction kernel whose split
depends on the shape): a row's result is a function of that row and the weights alone. K elementwise
passes over [rows, N]: fine for the small models exact mode runs on CPU; devices run `exact_kernel.py`.
"""

from __future__ import annotations

import torch

from ..exact import by_device
from .exact_kernel import linear_rows_triton


def linear_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) accumulated in fp32 (fp64 for fp64 inputs) in the order
    k = 0..K-1, then the bias, returned in `out_dtype` (default x's). bf16 / fp16 products are exact in fp32."""
    K, N = x.shape[-1], weight.shape[0]
    if weight.shape[-1] != K:
        raise ValueError(f"weight must be [N, K={K}], got {tuple(weight.shape)}")
    cd = torch.promote_types(x.dtype, torch.float32)
    rows = x.reshape(-1, K).to(cd)
    w_KN = weight.to(cd).t().contiguous()
    acc = torch.zeros(rows.shape[0], N, dtype=cd, device=x.device)
    for k in range(K):
        acc += rows[:, k, None] * w_KN[k]  # a product tensor, then an add: two roundings, never fused
    if bias is not None:
        acc += bias.to(cd)
    return acc.to(out_dtype or x.dtype).reshape(*x.shape[:-1], N)


# the per-row projection on any device: torch's elementwise form on cpu, the fixed-tile kernel elsewhere
_linear_rows_any = by_device(linear_rows, linear_rows_triton)


class LinearExactFunction(torch.autograd.Function):
    """forward: the per-row projection (`linear_rows` on cpu, its kernel on devices); backward: F.linear's
    gradient (dx = dy W, dW = dy^T x, db = sum dy), from the saved inputs: nothing to recompute."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _linear_rows_any(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy_rows, x_rows = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        dx = (dy_rows @ weight).view_as(x) if ctx.needs_input_grad[0] else None
        dw = dy_rows.t() @ x_rows if ctx.needs_input_grad[1] else None
        db = dy_rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


def linear_exact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The dispatched "exact" linear: `linear_rows`'s forward (per row, batch-invariant), F.linear's gradient."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return LinearExactFunction.apply(x, weight, bias)
    return _linear_rows_any(x, weight, bias)


__all__ = ["LinearExactFunction", "linear_exact", "linear_rows"]
