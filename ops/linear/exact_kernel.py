"""Exact mode's projection on devices: a Triton GEMM whose tiling never depends on the shape of the call.

A GEMM library picks its kernel (tile shape, split-K) by the problem's shape, so one row's result changes
with how many rows share the call. Here the tile shape, the K step and the warp count are fixed per dtype,
device and output width (`exact_config`), K is walked from 0 upwards without splitting, and each output element is
accumulated by the same sequence of tensor-core instructions whatever M is and whichever row of a tile it
lands in: a row's result is a function of that row and the weights alone.

Tiles run in groups of GROUP_M row blocks (column block outer within a group), so the programs resident
at one time share each weight tile across GROUP_M row blocks from L2: a [1024, 248320] head reads its
1 GiB weight about once per group instead of once per row block. The order changes no result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.launch import cdiv, dot_dtype, dot_precision, grid_1d, launch, stages_fit

# Configs of 16-bit operands by the projection's width N (fixed per weight, never by the row count M), each
# list in order of preference, the first whose stages fit in shared memory taken (`exact_config`). Chosen by
# `benchmarks/exact_tiles.py` at 256 rows (a decode step) and 16,384 (a training micro-batch): wide
# outputs run fastest in the large tiles at both; at 256 rows an output of N <= 2048 in 128 x 256 tiles
# leaves most SMs idle (N = 2048: 16 tiles), so narrower widths take narrower tiles.
CONFIG_16 = {"BM": 64, "BN": 128, "BK": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}  # fits everywhere
CONFIGS_16_WIDE = [
    {"BM": 128, "BN": 256, "BK": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4},
    {"BM": 128, "BN": 256, "BK": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
]
CONFIGS_16_MID = [{"BM": 128, "BN": 64, "BK": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}]  # N <= 2048
CONFIGS_16_NARROW = [{"BM": 64, "BN": 64, "BK": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}]  # N <= 256
CONFIG_32 = {"BM": 32, "BN": 64, "BK": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 2}
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
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    DT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """y [M, N] = x [M, K] @ w [N, K].T (+ b): one [BM, BN] tile per step of a grid-stride loop (tiles in
    groups of GROUP_M row blocks), K in ascending BK blocks into one fp32 accumulator (w read transposed
    through its strides)."""
    i_p, n_p = tl.program_id(0), tl.num_programs(0)
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for i_t in range(i_p, tiles_m * tiles_n, n_p):
        first_m = (i_t // (GROUP_M * tiles_n)) * GROUP_M
        rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
        i_in = i_t % (GROUP_M * tiles_n)
        o_m = (first_m + i_in % rows_in_group) * BM + tl.arange(0, BM)
        o_n = (i_in // rows_in_group) * BN + tl.arange(0, BN)
        m_m, m_n = o_m < M, o_n < N
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            o_k = k0 + tl.arange(0, BK)
            m_k = (o_k < K) | EVEN_K
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
        # the configs a launch off cuda can take (`stages_fit` is false there): the wide, mid and narrow
        # ones are Hopper-sized (a 128 x 256 accumulator) and never run on Ascend
        "configs": [CONFIG_16, CONFIG_32],
        "meta": lambda shape: {"EVEN_K": False},
        "grid": _grid,
        "runtime": lambda shape: {},
        "max_shapes": MAX_SHAPES,
    },
}


def exact_config(dtype: torch.dtype, N: int) -> dict:
    """The one tile config of a projection to N outputs from `dtype` operands on this device: fp32's; for
    16-bit operands the first of N's preferred configs whose stages fit in shared memory, else CONFIG_16."""
    if dtype == torch.float32:
        return CONFIG_32
    preferred = CONFIGS_16_NARROW if N <= 256 else CONFIGS_16_MID if N <= 2048 else CONFIGS_16_WIDE
    return next((c for c in preferred if stages_fit(c, c["BK"])), CONFIG_16)


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
        config = config or exact_config(x.dtype, N)
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
            EVEN_K=K % config["BK"] == 0,
            DT=dot_dtype(x.dtype),
            DOT_PREC=dot_precision(x.dtype),
        )
    return y.reshape(*x.shape[:-1], N)


__all__ = ["linear_rows_triton"]
