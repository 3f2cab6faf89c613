"""Exact mode's projection on devices: a Triton GEMM whose tiling never depends on the shape of the call.

A GEMM library picks its kernel (tile shape, split-K) by the problem's shape, so one row's result changes
with how many rows share the call. Here the tile shape, the K step and the warp count are fixed per dtype,
K is walked from 0 upwards without splitting, and each output element is accumulated by the same sequence
of tensor-core instructions whatever M is and whichever row of a tile it lands in: a row's result is a
function of that row and the weights alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.launch import cdiv, dot_dtype, dot_precision, grid_1d, launch

# One config per operand width: 16-bit operands run tensor-core tiles; fp32 ("ieee" dot) small ones.
CONFIG_16 = {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 3}
CONFIG_32 = {"BM": 32, "BN": 64, "BK": 32, "num_warps": 4, "num_stages": 2}
MAX_SHAPES = ({"M": 1 << 20, "N": 1 << 12}, {"M": 1 << 14, "N": 248320})


@triton.jit(do_not_specialize=["M"])
def _linear_rows_kernel(
    x,
    w,
    b,
    y,
    M,
    N,
    K,
    s_xm,
    s_wn,
    s_ym,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    DT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """y [M, N] = x [M, K] @ w [N, K].T (+ b): one [BM, BN] tile per step of a grid-stride loop, K in
    ascending BK blocks into one fp32 accumulator (w read transposed through its strides)."""
    i_p, n_p = tl.program_id(0), tl.num_programs(0)
    tiles_n = tl.cdiv(N, BN)
    for i_t in range(i_p, tl.cdiv(M, BM) * tiles_n, n_p):
        o_m = (i_t // tiles_n) * BM + tl.arange(0, BM)
        o_n = (i_t % tiles_n) * BN + tl.arange(0, BN)
        m_m, m_n = o_m < M, o_n < N
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            o_k = k0 + tl.arange(0, BK)
            m_k = o_k < K
            b_x = tl.load(
                x + o_m[:, None].to(tl.int64) * s_xm + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0
            )
            b_w = tl.load(
                w + o_n[None, :].to(tl.int64) * s_wn + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0.0
            )
            acc = tl.dot(b_x.to(DT), b_w.to(DT), acc, input_precision=DOT_PREC)
        if HAS_BIAS:
            acc += tl.load(b + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
        p_y = y + o_m[:, None].to(tl.int64) * s_ym + o_n[None, :]
        tl.store(p_y, acc.to(y.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


def _grid(meta: dict) -> tuple[int]:
    return grid_1d(cdiv(meta["M"], meta["BM"]) * cdiv(meta["N"], meta["BN"]))


KERNEL_LAUNCHES = {
    "_linear_rows_kernel": {
        "configs": [CONFIG_16, CONFIG_32],
        "meta": lambda shape: {},
        "grid": _grid,
        "runtime": lambda shape: {},
        "max_shapes": MAX_SHAPES,
    },
}


def linear_rows_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) accumulated in fp32, returned in `out_dtype` (default x's).
    x and weight share a dtype (bf16, fp16 or fp32)."""
    K, N = x.shape[-1], weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"weight must be [N, K={K}], got {tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x and weight must share a bf16 / fp16 / fp32 dtype, got {x.dtype} and {weight.dtype}")
    rows = x.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    M = rows.shape[0]
    y = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M and N:
        config = config or (CONFIG_32 if x.dtype == torch.float32 else CONFIG_16)
        launch(
            _linear_rows_kernel,
            [config],
            ["N", "K"],
            _grid,
            x=rows,
            w=weight,
            b=bias if bias is not None else weight,
            y=y,
            M=M,
            N=N,
            K=K,
            s_xm=rows.stride(0),
            s_wn=weight.stride(0),
            s_ym=y.stride(0),
            HAS_BIAS=bias is not None,
            DT=dot_dtype(x.dtype),
            DOT_PREC=dot_precision(x.dtype),
        )
    return y.reshape(*x.shape[:-1], N)


__all__ = ["linear_rows_triton"]
