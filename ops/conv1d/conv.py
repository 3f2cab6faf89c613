"""Depthwise causal conv1d (+ SiLU) over packed sequences on Triton: kernels, launchers, autograd Function.

Forward: y[t, c] = act(sum_j weight[c, j] * x[t - W + 1 + j, c] + bias[c]), x = 0 before t's own
sequence start. One program per tile of BT tokens x BC channels (1-D grid, looping); the W taps are
W shifted loads of the tile (the W - 1 halo rows come from cache, so DRAM reads each x element about
once). A token's sequence start is found in the kernel by a binary search of `cu_seqlens` (no
per-token table, no host copy); plain [B, T] input uses row // T.

Backward saves x only (in its dtype): the pre-activation is recomputed. x[t] feeds the outputs
u = t + k (k < W) through tap W - 1 - k, so dx[t] = sum_k weight[c, W-1-k] * dpre[u] over the u of
t's own sequence, with dpre[u] = dy[u] * silu'(pre[u]) and pre[u] recomputed in the program from
x masked at t's sequence start (outputs past t's sequence end are dropped, so their taps never
matter). The 2W - 1 shifted x tiles this reads come from cache (the compiler merges the loads of a
shift that several taps share); every dpre value stays in the program that uses it, so nothing is
written twice and there are no atomics. dweight / dbias: each program owns a group of rows x BC
channels and sums its rows in fp32 into its own slot of [n_groups, C, W] / [n_groups, C], reduced
once by torch: bitwise reproducible for a fixed config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..common.launch import cdiv, grid_1d, launch, next_pow2
from .reference import check_conv1d_inputs

# First configs: what the interpreter, fp32 inputs and deterministic mode run. Registers per thread
# from a static sm_90 build at C = 8192, W = 4 (this machine's Triton; the device's may differ), bf16,
# none spilling: forward 56-85, backward 96-124 (140-166 for 8 x 128 at 4 warps). The backward keeps
# the 2W - 1 shifted x tiles of a tile live, hence its small tiles (4-8 elements per thread).
# The first configs also build without spills for fp32 inputs (forward 102, backward 100).
FWD_CONFIGS = [
    {"BT": 32, "BC": 128, "num_warps": 8, "num_stages": 1},
    {"BT": 16, "BC": 128, "num_warps": 4, "num_stages": 1},
    {"BT": 16, "BC": 256, "num_warps": 8, "num_stages": 1},
    {"BT": 64, "BC": 64, "num_warps": 8, "num_stages": 1},
    {"BT": 32, "BC": 64, "num_warps": 4, "num_stages": 1},
    {"BT": 64, "BC": 128, "num_warps": 16, "num_stages": 1},
]
BWD_CONFIGS = [
    {"BT": 16, "BC": 64, "num_warps": 8, "num_stages": 1},
    {"BT": 8, "BC": 64, "num_warps": 4, "num_stages": 1},
    {"BT": 32, "BC": 64, "num_warps": 16, "num_stages": 1},
    {"BT": 16, "BC": 128, "num_warps": 16, "num_stages": 1},
    {"BT": 8, "BC": 128, "num_warps": 4, "num_stages": 1},
]
# Rows per backward program group: a multiple of every backward BT, so groups never split a tile.
MIN_GROUP_ROWS = 64
assert all(MIN_GROUP_ROWS % c["BT"] == 0 for c in BWD_CONFIGS)
# Row groups aimed at per channel block: enough programs to fill a GPU at C = 8192 while keeping
# the fp32 dweight partials ([n_groups, C, W]) a few MiB.
TARGET_GROUPS = 32

# Documented largest shapes, for the static rule check: 1M packed tokens, 64K sequences, C = 16384.
MAX_SHAPES = ({"T": 1 << 20, "N": 1 << 16, "C": 16384, "W": 4},)


@triton.jit
def _conv1d_seq_bounds(cu_seqlens, o_t, n_rows, T, n_seqs, n_search, IS_VARLEN: tl.constexpr):
    """(start, end) rows of each row o_t's sequence. Packed: the largest i <= n_seqs with
    cu_seqlens[i] <= o_t by binary search (n_search = bit_length(n_seqs) halvings; an empty sequence
    repeats a value and is passed over), then cu_seqlens[i], cu_seqlens[i + 1] (rows past the end
    get start n_rows and end 0, so every mask drops them). Plain: B rows of T."""
    if IS_VARLEN:
        lo = tl.zeros_like(o_t)
        hi = lo + n_seqs
        for _ in range(0, n_search):
            mid = (lo + hi + 1) // 2
            ok = tl.load(cu_seqlens + mid) <= o_t
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        b_st = tl.load(cu_seqlens + lo).to(tl.int32)
        b_en = tl.load(cu_seqlens + lo + 1, mask=lo < n_seqs, other=0).to(tl.int32)
    else:
        b_st = (o_t // T) * T
        b_en = tl.minimum(b_st + T, n_rows)
    return b_st, b_en


@triton.jit
def _conv1d_rows(x, o_t, s, b_st, n_rows, o_c, m_c, C: tl.constexpr):
    """x at rows o_t + s [BT] x channels o_c [BC] in fp32, zero before the start b_st of row o_t's
    sequence and outside the tensor. The mask depends on s only, so the loads of one shift that several
    taps share are one load to the compiler."""
    o_s = o_t + s
    m_s = (o_s >= b_st) & (o_s < n_rows)
    p_x = x + o_s.to(tl.int64)[:, None] * C + o_c[None, :]
    return tl.load(p_x, mask=m_s[:, None] & m_c[None, :], other=0.0).to(tl.float32)


@triton.jit
def _conv1d_pre(x, weight, b_pre, o_t, k, b_st, n_rows, o_c, m_c, C: tl.constexpr, W: tl.constexpr):
    """b_pre + the W taps of the outputs at rows o_t + k, in fp32, read from the sequence of row o_t
    (the caller ignores outputs that lie past its end)."""
    for j in tl.static_range(W):
        b_w = tl.load(weight + o_c * W + j, mask=m_c, other=0.0).to(tl.float32)
        b_pre += _conv1d_rows(x, o_t, k - (W - 1) + j, b_st, n_rows, o_c, m_c, C) * b_w[None, :]
    return b_pre


@triton.jit(do_not_specialize=["n_rows", "T", "n_seqs", "n_search"])
def _conv1d_fwd_kernel(
    x,
    weight,
    bias,
    cu_seqlens,
    y,
    n_rows,
    T,
    n_seqs,
    n_search,
    C: tl.constexpr,
    W: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """One program per tile of BT rows x BC channels of x [n_rows, C] (1-D grid, looping, rows
    outer so neighbouring tiles share their halo rows in cache) -> y [n_rows, C] in y's dtype."""
    i_p = tl.program_id(0)
    n_cb = tl.cdiv(C, BC)
    for i_tile in range(i_p, tl.cdiv(n_rows, BT) * n_cb, tl.num_programs(0)):
        i_t, i_c = i_tile // n_cb, i_tile % n_cb
        o_t = i_t * BT + tl.arange(0, BT)
        o_c = i_c * BC + tl.arange(0, BC)
        m_t, m_c = o_t < n_rows, o_c < C
        b_st, _ = _conv1d_seq_bounds(cu_seqlens, o_t, n_rows, T, n_seqs, n_search, IS_VARLEN)
        b_y = tl.zeros([BT, BC], dtype=tl.float32)
        if HAS_BIAS:
            b_y += tl.load(bias + o_c, mask=m_c, other=0.0).to(tl.float32)[None, :]
        b_y = _conv1d_pre(x, weight, b_y, o_t, 0, b_st, n_rows, o_c, m_c, C, W)
        if SILU:
            b_y = b_y * tl.sigmoid(b_y)
        p_y = y + o_t.to(tl.int64)[:, None] * C + o_c[None, :]
        tl.store(p_y, b_y.to(y.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])


@triton.jit
def _conv1d_dpre(
    x,
    weight,
    dy,
    b_bias,
    o_t,
    k,
    b_st,
    b_en,
    n_rows,
    o_c,
    m_c,
    C: tl.constexpr,
    W: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    SILU: tl.constexpr,
):
    """dL/dpre of the outputs at rows o_t + k in fp32, zero past the end b_en of row o_t's sequence:
    dy, times silu'(pre) with pre recomputed when SILU."""
    o_u = o_t + k
    m = (o_u < b_en)[:, None] & m_c[None, :]
    b_dp = tl.load(dy + o_u.to(tl.int64)[:, None] * C + o_c[None, :], mask=m, other=0.0).to(tl.float32)
    if SILU:
        b_pre = tl.zeros([BT, BC], dtype=tl.float32) + b_bias[None, :]
        b_pre = _conv1d_pre(x, weight, b_pre, o_t, k, b_st, n_rows, o_c, m_c, C, W)
        b_sg = tl.sigmoid(b_pre)
        b_dp = b_dp * b_sg * (1.0 + b_pre * (1.0 - b_sg))
    return b_dp


@triton.jit(do_not_specialize=["n_rows", "T", "n_seqs", "n_search", "group_rows"])
def _conv1d_bwd_kernel(
    x,
    weight,
    bias,
    cu_seqlens,
    dy,
    dx,
    dw_part,
    db_part,
    n_rows,
    T,
    n_seqs,
    n_search,
    group_rows,
    C: tl.constexpr,
    W: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """One program per (group of group_rows rows, BC channels) (1-D grid, looping), walking its rows
    in tiles of BT: dx [n_rows, C] in dx's dtype, and the group's fp32 sums dw_part[g] [C, W] and
    db_part[g] [C] over its rows. x[t] feeds the outputs u = t + k (k < W) of its own sequence through
    tap W - 1 - k; those outputs' pre-activations are recomputed from x, all within t's sequence."""
    i_p = tl.program_id(0)
    n_cb = tl.cdiv(C, BC)
    o_w = tl.arange(0, BW)
    for i_tile in range(i_p, tl.cdiv(n_rows, group_rows) * n_cb, tl.num_programs(0)):
        i_g, i_c = i_tile // n_cb, i_tile % n_cb
        o_c = i_c * BC + tl.arange(0, BC)
        m_c = o_c < C
        b_bias = tl.zeros([BC], dtype=tl.float32)
        if HAS_BIAS:
            b_bias = tl.load(bias + o_c, mask=m_c, other=0.0).to(tl.float32)
        b_dw = tl.zeros([BC, BW], dtype=tl.float32)
        b_db = tl.zeros([BC], dtype=tl.float32)
        for i_r in range(i_g * group_rows, i_g * group_rows + group_rows, BT):
            o_t = i_r + tl.arange(0, BT)
            m_t = o_t < n_rows
            b_st, b_en = _conv1d_seq_bounds(cu_seqlens, o_t, n_rows, T, n_seqs, n_search, IS_VARLEN)
            # k = 0 (u = t): the tile's own outputs, which also give dweight and dbias.
            b_dp = _conv1d_dpre(x, weight, dy, b_bias, o_t, 0, b_st, b_en, n_rows, o_c, m_c, C, W, BT, BC, SILU)
            b_db += tl.sum(b_dp, 0)
            for j in tl.static_range(W):
                b_x = _conv1d_rows(x, o_t, j - (W - 1), b_st, n_rows, o_c, m_c, C)
                b_dw += tl.where(o_w[None, :] == j, tl.sum(b_dp * b_x, 0)[:, None], 0.0)
            b_w = tl.load(weight + o_c * W + (W - 1), mask=m_c, other=0.0).to(tl.float32)
            b_dx = b_dp * b_w[None, :]
            for k in tl.static_range(1, W):
                b_dp = _conv1d_dpre(x, weight, dy, b_bias, o_t, k, b_st, b_en, n_rows, o_c, m_c, C, W, BT, BC, SILU)
                b_w = tl.load(weight + o_c * W + (W - 1 - k), mask=m_c, other=0.0).to(tl.float32)
                b_dx += b_dp * b_w[None, :]
            p_dx = dx + o_t.to(tl.int64)[:, None] * C + o_c[None, :]
            tl.store(p_dx, b_dx.to(dx.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])
        p_dw = dw_part + (i_g * C + o_c).to(tl.int64)[:, None] * W + o_w[None, :]
        tl.store(p_dw, b_dw, mask=m_c[:, None] & (o_w < W)[None, :])
        tl.store(db_part + (i_g * C + o_c).to(tl.int64), b_db, mask=m_c)


def _fwd_grid(meta: dict) -> tuple[int]:
    return grid_1d(cdiv(meta["n_rows"], meta["BT"]) * cdiv(meta["C"], meta["BC"]))


def _bwd_grid(meta: dict) -> tuple[int]:
    return grid_1d(cdiv(meta["n_rows"], meta["group_rows"]) * cdiv(meta["C"], meta["BC"]))


def _group_rows(n_rows: int) -> int:
    """Rows per backward group: a power of two >= MIN_GROUP_ROWS giving about TARGET_GROUPS groups."""
    return next_pow2(cdiv(n_rows, TARGET_GROUPS), MIN_GROUP_ROWS)


def _bwd_meta(shape: dict) -> dict:
    return {"BW": next_pow2(shape["W"], 1)}


def _fwd_runtime(shape: dict) -> dict:
    return {"n_rows": shape["T"]}


def _bwd_runtime(shape: dict) -> dict:
    return {"n_rows": shape["T"], "group_rows": _group_rows(shape["T"])}


KERNEL_LAUNCHES = {
    "_conv1d_fwd_kernel": {
        "configs": FWD_CONFIGS,
        "meta": lambda shape: {},
        "grid": _fwd_grid,
        "runtime": _fwd_runtime,
        "max_shapes": MAX_SHAPES,
    },
    "_conv1d_bwd_kernel": {
        "configs": BWD_CONFIGS,
        "meta": _bwd_meta,
        "grid": _bwd_grid,
        "runtime": _bwd_runtime,
        "max_shapes": MAX_SHAPES,
    },
}


@dataclass(frozen=True)
class Conv1dOptions:
    silu: bool
    seq_len: int  # tokens per row of plain [B, T] input (unused with cu_seqlens)


def _seq_args(cu_seqlens: torch.Tensor | None, x: torch.Tensor, T: int) -> dict:
    if cu_seqlens is None:
        return {"cu_seqlens": x, "T": max(T, 1), "n_seqs": 1, "n_search": 0, "IS_VARLEN": False}
    n_seqs = cu_seqlens.numel() - 1
    return {
        "cu_seqlens": cu_seqlens,
        "T": max(T, 1),
        "n_seqs": n_seqs,
        "n_search": n_seqs.bit_length(),
        "IS_VARLEN": True,
    }


def conv1d_fwd(x, weight, bias, cu_seqlens, opts: Conv1dOptions) -> torch.Tensor:
    """x [n_rows, C], weight [C, W], bias [C] or None, cu_seqlens [N+1] or None -> y [n_rows, C] in x's dtype."""
    n_rows, C = x.shape
    y = torch.empty_like(x)
    if y.numel() == 0:
        return y
    launch(
        _conv1d_fwd_kernel,
        FWD_CONFIGS,
        ["C", "W", "HAS_BIAS", "SILU", "IS_VARLEN"],
        _fwd_grid,
        x=x,
        weight=weight,
        bias=x if bias is None else bias,
        y=y,
        n_rows=n_rows,
        C=C,
        W=weight.shape[1],
        HAS_BIAS=bias is not None,
        SILU=opts.silu,
        **_seq_args(cu_seqlens, x, opts.seq_len),
    )
    return y


def conv1d_bwd(x, weight, bias, cu_seqlens, dy, opts: Conv1dOptions):
    """x, dy [n_rows, C] -> dx [n_rows, C] in x's dtype, dweight [C, W] and dbias [C] (None without
    bias) in their parameters' dtypes."""
    n_rows, C = x.shape
    W = weight.shape[1]
    dx = torch.empty_like(x)
    if x.numel() == 0:
        dw = torch.zeros_like(weight)
        return dx, dw, None if bias is None else torch.zeros_like(bias)
    group_rows = _group_rows(n_rows)
    n_groups = cdiv(n_rows, group_rows)
    dw_part = torch.empty(n_groups, C, W, dtype=torch.float32, device=x.device)
    db_part = torch.empty(n_groups, C, dtype=torch.float32, device=x.device)
    launch(
        _conv1d_bwd_kernel,
        BWD_CONFIGS,
        ["C", "W", "HAS_BIAS", "SILU", "IS_VARLEN"],
        _bwd_grid,
        x=x,
        weight=weight,
        bias=x if bias is None else bias,
        dy=dy,
        dx=dx,
        dw_part=dw_part,
        db_part=db_part,
        n_rows=n_rows,
        group_rows=group_rows,
        C=C,
        W=W,
        HAS_BIAS=bias is not None,
        SILU=opts.silu,
        **_seq_args(cu_seqlens, x, opts.seq_len),
        **_bwd_meta({"W": W}),
    )
    dw = dw_part.sum(0).to(weight.dtype)
    db = None if bias is None else db_part.sum(0).to(bias.dtype)
    return dx, dw, db


class CausalConv1dFunction(torch.autograd.Function):
    """Inputs: x [n_rows, C], weight [C, W], bias [C] or None, cu_seqlens [N+1] or None, opts."""

    @staticmethod
    def forward(ctx, x, weight, bias, cu_seqlens, opts: Conv1dOptions):
        y = conv1d_fwd(x, weight, bias, cu_seqlens, opts)
        ctx.save_for_backward(x, weight, bias, cu_seqlens)  # x in its own dtype; pre recomputed
        ctx.opts = opts
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, cu_seqlens = ctx.saved_tensors
        dx, dw, db = conv1d_bwd(x, weight, bias, cu_seqlens, dy.contiguous(), ctx.opts)
        return dx, dw, db, None, None


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv1d with optional SiLU on our Triton kernels (forward and backward).

    Args:
        x: [B, T, C] activations, bf16 / fp16 / fp32 (copied when not contiguous).
        weight: [C, W] per-channel taps (tap W - 1 multiplies the current token), any float dtype.
        bias: optional [C].
        activation: "silu" (alias "swish") or None.
        cu_seqlens: optional [N+1] int32/int64 offsets of packed sequences (needs B == 1); each
            sequence starts from zero left padding; empty sequences are allowed.
    Returns:
        [B, T, C] in x's dtype (math in fp32); gradients for x, weight and bias.
    Raises:
        ValueError: bad shapes, dtypes, activation or cu_seqlens, fp64 input (take the torch
            reference), or weight / bias on another device than x.
    """
    check_conv1d_inputs(x, weight, bias, activation, cu_seqlens)
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"the Triton conv1d takes bf16, fp16 or fp32 x, got {x.dtype} (use impl='torch')")
    params = [t for t in (weight, bias) if t is not None]
    if any(t.device != x.device for t in params):
        raise ValueError(f"x, weight and bias must share one device, got {[str(t.device) for t in (x, *params)]}")
    if cu_seqlens is not None and cu_seqlens.device != x.device:
        cu_seqlens = cu_seqlens.to(x.device)  # the kernels read the offsets
    B, T, C = x.shape
    opts = Conv1dOptions(silu=activation is not None, seq_len=T)
    y = CausalConv1dFunction.apply(
        x.contiguous().view(B * T, C),
        weight.contiguous(),
        None if bias is None else bias.contiguous(),
        cu_seqlens,
        opts,
    )
    return y.view(B, T, C)
