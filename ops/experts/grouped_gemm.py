"""Triton grouped GEMM for the expert MLP: y[s] = x[s] @ weight[e].T for the rows s of expert e, with
its backward, for devices and versions where torch has no grouped GEMM (NPU, torch without
`F.grouped_mm`, the interpreter), so no per-expert Python loop runs there.

    forward   y  [S, OUT] = x [S, IN]  @ weight[e].T     row-tile kernel, weight read as [IN, OUT]
    backward  dx [S, IN]  = dy [S, OUT] @ weight[e]       the same kernel, weight read as [OUT, IN]
              dweight[e]  = dy[rows e].T @ x[rows e]      one program per (expert, [BO, BI] tile)

Row tiles never straddle two experts: expert e owns cdiv(count_e, BM) tiles. Each program of the
row-tile kernel rebuilds that tile table from `offsets` in registers (a cumulative sum over the E
experts), so the work list needs no host sync, no extra launch, and follows the autotuned BM.
The weight gradient reduces each expert's rows inside one program in a fixed order: no atomics,
bitwise deterministic for a given config. fp32 accumulation; tl.dot operands in the input dtype on
devices (`dot_dtype`), fp32 under the interpreter.

Ascend rules: power-of-two tiles <= 128, 1-D grids <= 65535 with grid-stride loops, no tl.trans
(transposed operands are loaded through their strides), `if` only on constexprs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ..common.launch import cdiv, dot_dtype, dot_precision, grid_1d, launch, next_pow2

# The first config is what the interpreter, deterministic mode and fp32 inputs run: small tiles that
# fit registers and shared memory even with fp32 operands. The rest are for bf16 on Hopper-class GPUs
# (2 CTAs of [128, 128] fp32 accumulators per SM at 8 warps, 3-4 stages of 64-deep K blocks).
ROWS_CONFIGS = [
    {"BM": 64, "BN": 64, "num_warps": 4, "num_stages": 2},
    {"BM": 128, "BN": 128, "num_warps": 8, "num_stages": 3},
    {"BM": 128, "BN": 128, "num_warps": 8, "num_stages": 4},
    {"BM": 128, "BN": 64, "num_warps": 4, "num_stages": 4},
    {"BM": 64, "BN": 128, "num_warps": 4, "num_stages": 4},
]
DW_CONFIGS = [
    {"BO": 64, "BI": 64, "BM": 32, "num_warps": 4, "num_stages": 2},
    {"BO": 128, "BI": 128, "BM": 64, "num_warps": 8, "num_stages": 3},
    {"BO": 128, "BI": 128, "BM": 32, "num_warps": 8, "num_stages": 4},
    {"BO": 128, "BI": 64, "BM": 64, "num_warps": 4, "num_stages": 3},
    {"BO": 64, "BI": 128, "BM": 64, "num_warps": 4, "num_stages": 3},
]
# Up to SMALL_ROWS_PER_EXPERT rows per expert on average (decoding: 256 sequences, top-8 of 64 experts,
# is 32) the expert MLP's forward runs this kernel with one pinned config instead of F.grouped_mm: with few
# rows per expert it is the faster of the two, and F.grouped_mm pulls ahead at about 128 rows (the experts
# bench, docs/ops.md).
SMALL_ROWS_PER_EXPERT = 64
SMALL_ROWS_CONFIGS = [ROWS_CONFIGS[4]]
BK_MAX = 64  # reduction depth of one row-tile step (fixed, so EVEN_K is known before autotuning)
# The tile table lives in registers as [next_pow2(E)] vectors: past this many experts it would spill.
MAX_EXPERTS = 1024
# Documented largest shapes for the static rule check: 1M rows, 1024 experts, 8192-wide projections
# (the row-tile kernel's N and K are OUT and IN in the forward, IN and OUT for dx).
ROWS_MAX_SHAPES = ({"S": 1 << 20, "E": MAX_EXPERTS, "N": 8192, "K": 8192},)
DW_MAX_SHAPES = ({"S": 1 << 20, "E": MAX_EXPERTS, "OUT": 8192, "IN": 8192},)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["S"])
def _grouped_gemm_rows_kernel(
    a,
    b,
    c,
    offsets,
    S,
    E,
    N,
    K,
    stride_am,
    stride_ak,
    stride_be,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    EVEN_K: tl.constexpr,
    DT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """c[s] = a[s] @ b[e] for the rows s of group e: a [S, K], b [E, K, N] through its strides,
    c [S, N]. One work item is (row tile of one group, BN columns); the programs of a 1-D grid
    (an upper bound on the items) stride over the items the offsets really give."""
    i_p = tl.program_id(0)
    # Tile table from the group bounds clamped to [0, S], so that offsets out of range or out of
    # order (not checked: that needs a host sync) never address outside a or c.
    o_e = tl.arange(0, BLOCK_E)
    m_e = o_e < E
    b_end = tl.minimum(tl.maximum(tl.load(offsets + o_e, mask=m_e, other=0), 0), S)
    b_start = tl.minimum(tl.maximum(tl.load(offsets + o_e - 1, mask=m_e & (o_e > 0), other=0), 0), S)
    b_cnt = tl.maximum(b_end - b_start, 0)
    b_tiles = (b_cnt + BM - 1) // BM
    b_cum = tl.cumsum(b_tiles, 0)  # row tiles of groups 0..e
    n_n = tl.cdiv(N, BN)
    o_r = tl.arange(0, BM)
    o_k = tl.arange(0, BK)
    o_c = tl.arange(0, BN)
    for i_w in range(i_p, tl.sum(b_tiles, 0) * n_n, tl.num_programs(0)):
        i_t = i_w // n_n
        i_n = i_w % n_n
        m_before = b_cum <= i_t  # groups that end before row tile i_t
        i_e = tl.sum(m_before.to(tl.int32), 0)
        # The tile's rows lie in the group's clamped [start, end), whatever the offsets hold.
        row_lo = tl.minimum(tl.maximum(tl.load(offsets + i_e - 1, mask=i_e > 0, other=0), 0), S)
        row0 = (row_lo + (i_t - tl.sum(tl.where(m_before, b_tiles, 0), 0)) * BM).to(tl.int64)
        n_rows = tl.minimum(tl.maximum(tl.load(offsets + i_e), 0), S) - row0  # rows left in the group from row0
        o_n = i_n * BN + o_c
        m_n = o_n < N
        # Rows past the group reload its last row and are never stored: no row mask in the K loop.
        p_a = a + row0 * stride_am + tl.minimum(o_r, n_rows - 1)[:, None] * stride_am + o_k[None, :] * stride_ak
        p_b = b + i_e.to(tl.int64) * stride_be + o_k[:, None] * stride_bk + o_n[None, :] * stride_bn
        b_acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            if EVEN_K:
                b_a = tl.load(p_a)
                b_b = tl.load(p_b, mask=m_n[None, :], other=0.0)
            else:
                m_k = (k0 + o_k) < K
                b_a = tl.load(p_a, mask=m_k[None, :], other=0.0)
                b_b = tl.load(p_b, mask=m_k[:, None] & m_n[None, :], other=0.0)
            b_acc = tl.dot(b_a.to(DT), b_b.to(DT), b_acc, input_precision=DOT_PREC)
            p_a += BK * stride_ak
            p_b += BK * stride_bk
        p_c = c + row0 * stride_cm + o_r[:, None] * stride_cm + o_n[None, :] * stride_cn
        tl.store(p_c, b_acc.to(c.dtype.element_ty), mask=(o_r < n_rows)[:, None] & m_n[None, :])


@triton.jit(do_not_specialize=["S"])
def _grouped_gemm_dw_kernel(
    dy,
    x,
    offsets,
    dw,
    S,
    E,
    OUT,
    IN,
    stride_dym,
    stride_dyo,
    stride_xm,
    stride_xi,
    BO: tl.constexpr,
    BI: tl.constexpr,
    BM: tl.constexpr,
    DT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """dw[e] = dy[rows e].T @ x[rows e]: dy [S, OUT], x [S, IN], dw [E, OUT, IN] contiguous. One work
    item is (group, BO x BI tile of dw), reducing the group's rows in BM blocks (zero for an empty
    group); the programs of a 1-D grid stride over E * tiles items."""
    i_p = tl.program_id(0)
    n_o = tl.cdiv(OUT, BO)
    n_i = tl.cdiv(IN, BI)
    o_r = tl.arange(0, BM)
    o_bo = tl.arange(0, BO)
    o_bi = tl.arange(0, BI)
    for i_w in range(i_p, E * n_o * n_i, tl.num_programs(0)):
        i_e = i_w // (n_o * n_i)
        i_o = (i_w // n_i) % n_o
        i_i = i_w % n_i
        # Group bounds clamped to [0, S] as in the row-tile kernel: bad offsets stay inside dy and x.
        row_hi = tl.minimum(tl.maximum(tl.load(offsets + i_e), 0), S).to(tl.int64)
        row_lo = tl.minimum(tl.maximum(tl.load(offsets + i_e - 1, mask=i_e > 0, other=0), 0), row_hi).to(tl.int64)
        o_o = i_o * BO + o_bo
        o_i = i_i * BI + o_bi
        m_o = o_o < OUT
        m_i = o_i < IN
        b_acc = tl.zeros([BO, BI], dtype=tl.float32)
        for m0 in range(row_lo, row_hi, BM):
            m_r = o_r < row_hi - m0
            # dy's rows loaded as the columns of a [BO, BM] tile: the transpose is in the strides.
            p_dy = dy + m0 * stride_dym + o_r[None, :] * stride_dym + o_o[:, None] * stride_dyo
            p_x = x + m0 * stride_xm + o_r[:, None] * stride_xm + o_i[None, :] * stride_xi
            b_dy = tl.load(p_dy, mask=m_r[None, :] & m_o[:, None], other=0.0)
            b_x = tl.load(p_x, mask=m_r[:, None] & m_i[None, :], other=0.0)
            b_acc = tl.dot(b_dy.to(DT), b_x.to(DT), b_acc, input_precision=DOT_PREC)
        # int64 expert base (the interpreter's loop index is a Python int, so no .to on it)
        p_w = dw + tl.full([], i_e, tl.int64) * OUT * IN + o_o[:, None] * IN + o_i[None, :]
        tl.store(p_w, b_acc.to(dw.dtype.element_ty), mask=m_o[:, None] & m_i[None, :])


def _rows_meta(shape: dict) -> dict:
    """Tile constexprs of the row-tile kernel that do not depend on the config (K: reduced width)."""
    BK = min(BK_MAX, next_pow2(shape["K"]))
    return {"BK": BK, "BLOCK_E": next_pow2(shape["E"]), "EVEN_K": shape["K"] % BK == 0}


def _rows_grid(meta: dict) -> tuple[int]:
    # Groups add at most one partial tile each, and a non-empty group holds at least one row.
    row_tiles = min(cdiv(meta["S"], meta["BM"]) + meta["E"], meta["S"])
    return grid_1d(row_tiles * cdiv(meta["N"], meta["BN"]))


def _dw_grid(meta: dict) -> tuple[int]:
    return grid_1d(meta["E"] * cdiv(meta["OUT"], meta["BO"]) * cdiv(meta["IN"], meta["BI"]))


KERNEL_LAUNCHES = {
    "_grouped_gemm_rows_kernel": {
        "configs": ROWS_CONFIGS,
        "meta": _rows_meta,
        "grid": _rows_grid,
        "runtime": lambda shape: {},
        "max_shapes": ROWS_MAX_SHAPES,
    },
    "_grouped_gemm_dw_kernel": {
        "configs": DW_CONFIGS,
        "meta": lambda shape: {},
        "grid": _dw_grid,
        "runtime": lambda shape: {},
        "max_shapes": DW_MAX_SHAPES,
    },
}


def grouped_gemm_rows(
    a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, configs: list[dict] = ROWS_CONFIGS
) -> torch.Tensor:
    """a [S, K], b [E, K, N] (any strides, e.g. weight.transpose(1, 2)), offsets [E] -> [S, N] in
    a's dtype: row s of group e is a[s] @ b[e]. configs: what the autotuner searches (its key has no S:
    a caller at a different scale of S, e.g. decoding, pins its own)."""
    S, K = a.shape
    E, _, N = b.shape
    c = torch.empty(S, N, dtype=a.dtype, device=a.device)
    if S == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_()
    launch(
        _grouped_gemm_rows_kernel,
        configs,
        ["E", "N", "K", "stride_bk", "stride_bn"],
        _rows_grid,
        a=a,
        b=b,
        c=c,
        offsets=offsets,
        S=S,
        E=E,
        N=N,
        K=K,
        stride_am=a.stride(0),
        stride_ak=a.stride(1),
        stride_be=b.stride(0),
        stride_bk=b.stride(1),
        stride_bn=b.stride(2),
        stride_cm=c.stride(0),
        stride_cn=c.stride(1),
        DT=dot_dtype(a.dtype),
        DOT_PREC=dot_precision(a.dtype),
        **_rows_meta({"K": K, "E": E}),
    )
    return c


def grouped_gemm_dw(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, E: int) -> torch.Tensor:
    """dy [S, OUT], x [S, IN], offsets [E] -> dweight [E, OUT, IN] in x's dtype: dy[rows e].T @ x[rows e]
    (zero for an empty group, and for every group when S == 0)."""
    S, OUT = dy.shape
    IN = x.shape[1]
    dw = torch.empty(E, OUT, IN, dtype=x.dtype, device=x.device)
    if S == 0:
        return dw.zero_()
    if dw.numel() == 0:
        return dw
    launch(
        _grouped_gemm_dw_kernel,
        DW_CONFIGS,
        ["E", "OUT", "IN"],
        _dw_grid,
        dy=dy,
        x=x,
        offsets=offsets,
        dw=dw,
        S=S,
        E=E,
        OUT=OUT,
        IN=IN,
        stride_dym=dy.stride(0),
        stride_dyo=dy.stride(1),
        stride_xm=x.stride(0),
        stride_xi=x.stride(1),
        DT=dot_dtype(x.dtype),
        DOT_PREC=dot_precision(x.dtype),
    )
    return dw


class GroupedGemmFunction(torch.autograd.Function):
    """y = grouped_gemm(x, weight, offsets); saves x, weight and offsets (input dtype, no copies)."""

    @staticmethod
    def forward(ctx, x, weight, offsets):
        ctx.save_for_backward(x, weight, offsets)
        return grouped_gemm_rows(x, weight.transpose(1, 2), offsets)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, offsets = ctx.saved_tensors
        dx = grouped_gemm_rows(dy, weight, offsets) if ctx.needs_input_grad[0] else None
        dw = grouped_gemm_dw(dy, x, offsets, weight.shape[0]) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def check_grouped_gemm_inputs(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> None:
    """Raise ValueError unless x [S, IN], weight [E, OUT, IN] (same float dtype and device) and offsets
    [E] int32/int64 fit together. The offsets' values are not read (that would be a host sync): the kernels
    clamp group bounds to [0, S] and skip out-of-order groups, so they never address outside the
    tensors; rows past offsets[-1] are left unwritten."""
    if x.dim() != 2 or weight.dim() != 3:
        raise ValueError(
            f"grouped_gemm: x must be [S, IN] and weight [E, OUT, IN], got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if x.shape[1] != weight.shape[2]:
        raise ValueError(f"grouped_gemm: x has {x.shape[1]} columns but weight [E, OUT, IN] has IN={weight.shape[2]}")
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"grouped_gemm: x and weight must share one of {DTYPES}, got {x.dtype}, {weight.dtype}")
    if offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64) or len(offsets) != weight.shape[0]:
        raise ValueError(
            f"grouped_gemm: offsets must be [E={weight.shape[0]}] int32/int64, got {tuple(offsets.shape)} {offsets.dtype}"
        )
    if not 1 <= weight.shape[0] <= MAX_EXPERTS:
        raise ValueError(f"grouped_gemm: E={weight.shape[0]} experts, supported 1..{MAX_EXPERTS}")
    if not x.device == weight.device == offsets.device:
        raise ValueError(f"grouped_gemm: x, weight, offsets on {x.device}, {weight.device}, {offsets.device}")


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped linear over expert-sorted rows (the contract of `grouped.grouped_linear`).

    Args:
        x: [S, IN] fp32/bf16/fp16, rows sorted by group (any strides).
        weight: [E, OUT, IN] in x's dtype (transformers' layout: gate_up_proj [E, 2I, D], down_proj [E, D, I]).
        offsets: [E] int32/int64 cumulative row ends (non-decreasing, offsets[-1] == S).
    Returns:
        [S, OUT] in x's dtype: row s of group e is x[s] @ weight[e].T (fp32 accumulation). Differentiable
        in x and weight; S == 0 gives an empty output and a zero weight gradient.
    Raises:
        ValueError: shapes, dtypes or devices that do not fit (see `check_grouped_gemm_inputs`).
    """
    check_grouped_gemm_inputs(x, weight, offsets)
    return GroupedGemmFunction.apply(x, weight, offsets)
