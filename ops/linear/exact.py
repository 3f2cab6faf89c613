"""The batch-invariant projection of exact mode: in PyTorch here (the CPU form), in Triton on devices
(`exact_kernel.py`).

A GEMM library picks its blocking (and its order of summation over K) by the shape of the call, so
one row's result changes with how many rows share it: a decode step of 16 rows and a packed forward
of 2,000 round differently. Here every output is accumulated over K in one fixed order, k = 0, 1, ...,
by separate elementwise multiplies and adds (no fused multiply-add, no reduction kernel whose split
depends on the shape): a row's result is a function of that row and the weights alone. K elementwise
passes over [rows, N]: fine for the small models exact mode runs on CPU, not a GPU kernel.
"""

from __future__ import annotations

import torch

from ..exact import by_device, exact_forward
from .exact_kernel import linear_rows_triton
from .reference import linear_ref


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


def _linear_rows(x, weight, bias=None):
    return linear_rows(x, weight, bias)


# the dispatched "exact" linear: linear_rows (cpu) or its kernel (devices) forward, F.linear's gradient
linear_exact = exact_forward(by_device(_linear_rows, linear_rows_triton), linear_ref)

__all__ = ["linear_exact", "linear_rows"]
