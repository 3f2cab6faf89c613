"""Depthwise causal conv1d (+ SiLU) over packed sequences on Triton: kernels, launchers, autograd Function.

Forward: y[t, c] = act(sum_j weight[c, j] * x[t - W + 1 + j, c] + bias[c]), x = 0 before t's own
sequence start. One program per tile of BT tokens x BC channels (1-D grid, looping); the W taps are
W shifted loads of the tile (the W - 1 halo rows come from cache, so DRAM reads each x element about
once). A token's sequence start is found in the kernel by a binary search of `cu_seqlens` (no
per-token table, no host copy); plain [B, T] input uses row // T.

Backward saves x only (in its dtype): the pre-activation is recomputed, once per token. x[t] feeds
the outputs u = t + k (k < W) through tap W - 1 - k, so with dz[u] = dy[u] * silu'(pre[u]):
dx[t] = sum_k weight[c, W-1-k] * dz[t + k] over the t + k of t's own sequence, and
dweight[c, j] = sum_u dz[u] * x[u - W + 1 + j] (x zero before u's sequence start). Three launches:
1. a per-row table of sequence starts and ends (packed input only; one binary search per row);
2. dz: one program per (group of rows, channel block) walks its rows in tiles, writes dz [T, C] in
   x's dtype and sums its rows' dweight (and dbias) in fp32 into its own slot of [n_groups, C, W];
3. dx: the W taps applied to W shifted dz tiles (the halo rows from cache).
dz costs one more write and read of [T, C] than a fused kernel, which would recompute W
pre-activations and sigmoids per token and be instruction-bound. Tiles are [BT <= 8, BC = 8 x 32 x
warps], so (bf16) each thread holds whole columns of 8 channels: 16-byte loads, and row sums in
registers (tiles with rows spread over warps sum through shared memory and barriers every tile).
Each program loads the next tile's new rows one tile ahead, so their DRAM latency overlaps the
current tile. No atomics: the partials are reduced once by torch, bitwise reproducible for a fixed
config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..common.launch import cdiv, grid_1d, launch, next_pow2
from ..device import to_device
from ..varlen import HostOffsets
from .reference import check_conv1d_inputs

# First configs: what the interpreter, fp32 inputs and deterministic mode run. Registers per thread
# from a static sm_90 build at C = 8192, W = 4 (another Triton version may allocate otherwise), bf16,
# none spilling: forward 56-85; its first config also builds without spills for fp32 (102).
FWD_CONFIGS = [
    {"BT": 32, "BC": 128, "num_warps": 8, "num_stages": 1},
    {"BT": 16, "BC": 128, "num_warps": 4, "num_stages": 1},
    {"BT": 16, "BC": 256, "num_warps": 8, "num_stages": 1},
    {"BT": 64, "BC": 64, "num_warps": 8, "num_stages": 1},
    {"BT": 32, "BC": 64, "num_warps": 4, "num_stages": 1},
    {"BT": 64, "BC": 128, "num_warps": 16, "num_stages": 1},
]
# Backward kernels: tiles short in rows and wide in channels, BC = 8 x 32 x num_warps, so that (bf16)
# each thread holds all BT rows of 8 channels: 16-byte loads, and the row sums of dweight stay in
# registers (no shared memory, no barrier in the row loop). Static sm_90 builds at C = 8192, W = 4
# (Triton 3.6), registers per thread bf16 / fp32, none spilling:
# dz 128/168, 128/168, 157/174, 84/120, 86/134; dx 100/105, 151/188, 106/102, 151/188, 100/105, 64/64.
# (BT = 4 dz tiles take 237 registers in bf16 and spill in fp32.)
BWD_DZ_CONFIGS = [
    {"BT": 2, "BC": 1024, "num_warps": 4, "num_stages": 1},
    {"BT": 2, "BC": 512, "num_warps": 2, "num_stages": 1},
    {"BT": 2, "BC": 2048, "num_warps": 8, "num_stages": 1},
    {"BT": 1, "BC": 1024, "num_warps": 4, "num_stages": 1},
    {"BT": 1, "BC": 2048, "num_warps": 8, "num_stages": 1},
]
BWD_DX_CONFIGS = [
    {"BT": 4, "BC": 1024, "num_warps": 4, "num_stages": 1},
    {"BT": 8, "BC": 1024, "num_warps": 4, "num_stages": 1},
    {"BT": 4, "BC": 2048, "num_warps": 8, "num_stages": 1},
    {"BT": 8, "BC": 512, "num_warps": 2, "num_stages": 1},
    {"BT": 4, "BC": 512, "num_warps": 2, "num_stages": 1},
    {"BT": 2, "BC": 1024, "num_warps": 4, "num_stages": 1},
]
BOUNDS_CONFIGS = [{"BLOCK": 1024, "num_warps": 4, "num_stages": 1}]
# Rows per dz-kernel group: a multiple of every BT there, so groups never split a tile.
MIN_GROUP_ROWS = 64
assert all(MIN_GROUP_ROWS % c["BT"] == 0 for c in BWD_DZ_CONFIGS + BWD_DX_CONFIGS)
# Rows per dx-kernel program (no partials there, so short: ~1000 programs at 8192 x 8192).
DX_GROUP_ROWS = MIN_GROUP_ROWS
# Programs aimed at for the dz kernel (rows walked serially per program): ~4 per SM of a 132-SM
# GPU at the nominal 1024-channel tile (the first config's 128 registers let 4 share an SM), while
# the fp32 dweight partials [n_groups, C, W] stay small: 8 MiB, ~4% of the kernel's traffic, at
# 8192 x 8192 (64 groups of 128 rows).
TARGET_DZ_PROGRAMS = 512
NOMINAL_BC = 1024

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


@triton.jit(do_not_specialize=["n_rows", "n_seqs", "n_search"])
def _conv1d_bounds_kernel(cu_seqlens, starts, ends, n_rows, n_seqs, n_search, BLOCK: tl.constexpr):
    """One program per BLOCK rows (1-D grid, looping): starts / ends [n_rows] int32, the first row of
    each row's sequence and one past its last, for the backward kernels to read per row (a search
    there would run per row tile and per channel block)."""
    i_p = tl.program_id(0)
    for i_b in range(i_p, tl.cdiv(n_rows, BLOCK), tl.num_programs(0)):
        o_t = i_b * BLOCK + tl.arange(0, BLOCK)
        b_st, b_en = _conv1d_seq_bounds(cu_seqlens, o_t, n_rows, 1, n_seqs, n_search, True)
        tl.store(starts + o_t, b_st, mask=o_t < n_rows)
        tl.store(ends + o_t, b_en, mask=o_t < n_rows)


@triton.jit
def _conv1d_tile_rows(table, t0, n_rows, other, BT: tl.constexpr):
    """table[t0 .. t0 + BT - 1] as a [BT] int32 vector (`other` past n_rows) from BT scalar loads:
    the values are the same in every thread, so they land in the tile's row layout directly (a [BT]
    vector load would get a layout of its own and be shuffled through shared memory, with a barrier)."""
    o_r = tl.arange(0, BT)
    b = tl.zeros([BT], dtype=tl.int32)
    for r in tl.static_range(BT):
        b = tl.where(o_r == r, tl.load(table + t0 + r, mask=t0 + r < n_rows, other=other), b)
    return b


@triton.jit(do_not_specialize=["n_rows", "T", "group_rows"])
def _conv1d_bwd_dz_kernel(
    x,
    weight_t,
    bias,
    starts,
    dy,
    dz,
    dw_part,
    db_part,
    n_rows,
    T,
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
    in tiles of BT: dz = dy * silu'(pre) [n_rows, C] in dz's dtype (SILU; else dz is dy and not
    written), and the group's fp32 sums dw_part[g] [C, W] (over rows t of dz[t] * x[t - W + 1 + j],
    x zero before t's sequence start) and db_part[g] [C] (of dz; HAS_BIAS only).
    A tile's own dy and x rows (the only ones not yet in cache) are loaded one tile ahead, so their
    DRAM latency overlaps the previous tile's work; the W - 1 shifted x tiles are re-read from cache."""
    i_p = tl.program_id(0)
    n_cb = tl.cdiv(C, BC)
    o_w = tl.arange(0, BW)
    o_r = tl.arange(0, BT)
    for i_tile in range(i_p, tl.cdiv(n_rows, group_rows) * n_cb, tl.num_programs(0)):
        i_g, i_c = i_tile // n_cb, i_tile % n_cb
        o_c = i_c * BC + tl.arange(0, BC)
        m_c = o_c < C
        b_bias = tl.zeros([BC], dtype=tl.float32)
        if HAS_BIAS:
            b_bias = tl.load(bias + o_c, mask=m_c, other=0.0).to(tl.float32)
        b_dw = tl.zeros([BW, BC], dtype=tl.float32)
        b_db = tl.zeros([BC], dtype=tl.float32)
        r0 = i_g * group_rows
        o_2d = o_r[:, None] * C + o_c[None, :]  # int32 offsets of a tile from its first row
        m_next = (o_r < n_rows - r0)[:, None] & m_c[None, :]
        b_dy_next = tl.load(dy + tl.cast(r0, tl.int64) * C + o_2d, mask=m_next, other=0.0)
        b_x_next = tl.load(x + tl.cast(r0, tl.int64) * C + o_2d, mask=m_next, other=0.0)
        for i_r in range(r0, tl.minimum(r0 + group_rows, n_rows), BT):
            b_dz = b_dy_next.to(tl.float32)
            b_x0 = b_x_next.to(tl.float32)  # each row's own x: never before its sequence start
            p_x = x + tl.cast(i_r, tl.int64) * C  # the tile's base pointers (int64)
            p_dy = dy + tl.cast(i_r, tl.int64) * C
            n_left = n_rows - i_r  # rows from i_r to the end of the tensor
            m_next = (o_r < n_left - BT)[:, None] & m_c[None, :]
            b_dy_next = tl.load(p_dy + BT * C + o_2d, mask=m_next, other=0.0)
            b_x_next = tl.load(p_x + BT * C + o_2d, mask=m_next, other=0.0)
            # each row's sequence start, as an offset from i_r (n_left past the last row)
            if IS_VARLEN:
                b_st = _conv1d_tile_rows(starts, i_r, n_rows, n_rows, BT) - i_r
            else:
                b_st = ((i_r + o_r) // T) * T - i_r
            if SILU:
                b_w = tl.load(weight_t + (W - 1) * C + o_c, mask=m_c, other=0.0).to(tl.float32)
                b_pre = b_x0 * b_w[None, :]
                if HAS_BIAS:
                    b_pre += b_bias[None, :]
                for j in tl.static_range(W - 1):
                    o_s = o_r + (j - (W - 1))  # rows of tap j, zero before each row's sequence start
                    m_s = ((o_s >= b_st) & (o_s < n_left))[:, None] & m_c[None, :]
                    b_x = tl.load(p_x + (j - (W - 1)) * C + o_2d, mask=m_s, other=0.0).to(tl.float32)
                    b_w = tl.load(weight_t + j * C + o_c, mask=m_c, other=0.0).to(tl.float32)
                    b_pre += b_x * b_w[None, :]
                b_sg = tl.sigmoid(b_pre)
                b_dz = b_dz * b_sg * (1.0 + b_pre * (1.0 - b_sg))
                # Stored before dweight re-reads the shifted x rows (from cache): the compiler cannot
                # merge loads across the store, so the W fp32 x tiles are not all kept live.
                p_dz = dz + tl.cast(i_r, tl.int64) * C + o_2d
                tl.store(p_dz, b_dz.to(dz.dtype.element_ty), mask=(o_r < n_left)[:, None] & m_c[None, :])
            if HAS_BIAS:
                b_db += tl.sum(b_dz, 0)
            # per tap: a select between the updated and the old accumulator, so only tap j's row adds
            b_dw = tl.where(o_w[:, None] == W - 1, b_dw + tl.sum(b_dz * b_x0, 0)[None, :], b_dw)
            for j in tl.static_range(W - 1):
                o_s = o_r + (j - (W - 1))
                m_s = ((o_s >= b_st) & (o_s < n_left))[:, None] & m_c[None, :]
                b_x = tl.load(p_x + (j - (W - 1)) * C + o_2d, mask=m_s, other=0.0).to(tl.float32)
                b_dw = tl.where(o_w[:, None] == j, b_dw + tl.sum(b_dz * b_x, 0)[None, :], b_dw)
        p_dw = dw_part + (i_g * C + o_c).to(tl.int64)[None, :] * W + o_w[:, None]
        tl.store(p_dw, b_dw, mask=(o_w < W)[:, None] & m_c[None, :])
        if HAS_BIAS:
            tl.store(db_part + (i_g * C + o_c).to(tl.int64), b_db, mask=m_c)


@triton.jit(do_not_specialize=["n_rows", "T", "group_rows"])
def _conv1d_bwd_dx_kernel(
    dz,
    weight_t,
    ends,
    dx,
    n_rows,
    T,
    group_rows,
    C: tl.constexpr,
    W: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """One program per (group of group_rows rows, BC channels) (1-D grid, looping), walking its rows
    in tiles of BT: dx[t] = sum_k weight[:, W - 1 - k] * dz[t + k] over the t + k before the end of
    t's own sequence, in dx's dtype. Of the W shifted dz tiles only the last (shift W - 1) holds rows
    not yet in cache; it is loaded one tile ahead, the others are re-read from cache."""
    i_p = tl.program_id(0)
    n_cb = tl.cdiv(C, BC)
    o_r = tl.arange(0, BT)
    for i_tile in range(i_p, tl.cdiv(n_rows, group_rows) * n_cb, tl.num_programs(0)):
        i_g, i_c = i_tile // n_cb, i_tile % n_cb
        o_c = i_c * BC + tl.arange(0, BC)
        m_c = o_c < C
        r0 = i_g * group_rows
        o_2d = o_r[:, None] * C + o_c[None, :]  # int32 offsets of a tile from its first row
        m_last = (o_r + (W - 1) < n_rows - r0)[:, None] & m_c[None, :]
        b_last_next = tl.load(dz + tl.cast(r0, tl.int64) * C + (W - 1) * C + o_2d, mask=m_last, other=0.0)
        for i_r in range(r0, tl.minimum(r0 + group_rows, n_rows), BT):
            p_dz = dz + tl.cast(i_r, tl.int64) * C  # the tile's base pointer (int64)
            b_last = b_last_next
            m_last = (o_r + (BT + W - 1) < n_rows - i_r)[:, None] & m_c[None, :]
            b_last_next = tl.load(p_dz + (BT + W - 1) * C + o_2d, mask=m_last, other=0.0)
            # each row's sequence end, as an offset from i_r (0 past the last row)
            if IS_VARLEN:
                b_en = _conv1d_tile_rows(ends, i_r, n_rows, 0, BT) - i_r
            else:
                b_en = tl.minimum(((i_r + o_r) // T) * T + T, n_rows) - i_r
            b_w = tl.load(weight_t + o_c, mask=m_c, other=0.0).to(tl.float32)
            b_dx = tl.where((o_r + (W - 1) < b_en)[:, None], b_last.to(tl.float32), 0.0) * b_w[None, :]
            for k in tl.static_range(W - 1):
                m_k = (o_r + k < b_en)[:, None] & m_c[None, :]
                b_dz = tl.load(p_dz + k * C + o_2d, mask=m_k, other=0.0).to(tl.float32)
                b_w = tl.load(weight_t + (W - 1 - k) * C + o_c, mask=m_c, other=0.0).to(tl.float32)
                b_dx += b_dz * b_w[None, :]
            p_dx = dx + tl.cast(i_r, tl.int64) * C + o_2d
            tl.store(p_dx, b_dx.to(dx.dtype.element_ty), mask=(o_r < n_rows - i_r)[:, None] & m_c[None, :])


def _fwd_grid(meta: dict) -> tuple[int]:
    return grid_1d(cdiv(meta["n_rows"], meta["BT"]) * cdiv(meta["C"], meta["BC"]))


def _bounds_grid(meta: dict) -> tuple[int]:
    return grid_1d(cdiv(meta["n_rows"], meta["BLOCK"]))


def _dz_grid(meta: dict) -> tuple[int]:
    return grid_1d(cdiv(meta["n_rows"], meta["group_rows"]) * cdiv(meta["C"], meta["BC"]))


def _group_rows(n_rows: int, C: int) -> int:
    """Rows per dz-kernel group: a power of two >= MIN_GROUP_ROWS giving about TARGET_DZ_PROGRAMS
    programs at NOMINAL_BC channels per tile (fixed before the config is picked: it sizes the partials)."""
    n_groups = max(1, TARGET_DZ_PROGRAMS // cdiv(C, NOMINAL_BC))
    return next_pow2(cdiv(n_rows, n_groups), MIN_GROUP_ROWS)


def _dz_meta(shape: dict) -> dict:
    return {"BW": next_pow2(shape["W"], 1)}


def _fwd_runtime(shape: dict) -> dict:
    return {"n_rows": shape["T"]}


def _dz_runtime(shape: dict) -> dict:
    return {"n_rows": shape["T"], "group_rows": _group_rows(shape["T"], shape["C"])}


KERNEL_LAUNCHES = {
    "_conv1d_fwd_kernel": {
        "configs": FWD_CONFIGS,
        "meta": lambda shape: {},
        "grid": _fwd_grid,
        "runtime": _fwd_runtime,
        "max_shapes": MAX_SHAPES,
    },
    "_conv1d_bounds_kernel": {
        "configs": BOUNDS_CONFIGS,
        "meta": lambda shape: {},
        "grid": _bounds_grid,
        "runtime": _fwd_runtime,
        "max_shapes": MAX_SHAPES,
    },
    "_conv1d_bwd_dz_kernel": {
        "configs": BWD_DZ_CONFIGS,
        "meta": _dz_meta,
        "grid": _dz_grid,
        "runtime": _dz_runtime,
        "max_shapes": MAX_SHAPES,
    },
    "_conv1d_bwd_dx_kernel": {
        "configs": BWD_DX_CONFIGS,
        "meta": lambda shape: {},
        "grid": _dz_grid,
        "runtime": lambda shape: {"n_rows": shape["T"], "group_rows": DX_GROUP_ROWS},
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
    bias) in their parameters' dtypes. Three launches: per-row sequence bounds (packed input only),
    dz + dweight/dbias partials, dx."""
    n_rows, C = x.shape
    W = weight.shape[1]
    dx = torch.empty_like(x)
    if x.numel() == 0:
        dw = torch.zeros_like(weight)
        return dx, dw, None if bias is None else torch.zeros_like(bias)
    seq = _seq_args(cu_seqlens, x, opts.seq_len)
    starts = ends = x  # not read for plain [B, T] input
    if cu_seqlens is not None:
        starts = torch.empty(n_rows, dtype=torch.int32, device=x.device)
        ends = torch.empty(n_rows, dtype=torch.int32, device=x.device)
        launch(
            _conv1d_bounds_kernel,
            BOUNDS_CONFIGS,
            [],
            _bounds_grid,
            cu_seqlens=cu_seqlens,
            starts=starts,
            ends=ends,
            n_rows=n_rows,
            n_seqs=seq["n_seqs"],
            n_search=seq["n_search"],
        )
    group_rows = _group_rows(n_rows, C)
    n_groups = cdiv(n_rows, group_rows)
    dw_part = torch.empty(n_groups, C, W, dtype=torch.float32, device=x.device)
    db_part = torch.empty(n_groups, C, dtype=torch.float32, device=x.device)
    # dz in x's dtype: one write and one read of [n_rows, C] more than a fused kernel, which would
    # recompute W pre-activations (and sigmoids) per token instead; its rounding (bf16: 2^-9
    # relative) is that of dx's own output.
    dz = torch.empty_like(x) if opts.silu else dy
    # [W, C]: each tap one contiguous row. Kept in weight's dtype: a tap vector then gets the same
    # register layout as the activation tiles when the dtypes match (an fp32 tap next to bf16 tiles
    # would be shuffled through shared memory on every tile).
    weight_t = weight.t().contiguous()
    common = {"weight_t": weight_t, "n_rows": n_rows, "T": seq["T"], "C": C, "W": W, "IS_VARLEN": seq["IS_VARLEN"]}
    launch(
        _conv1d_bwd_dz_kernel,
        BWD_DZ_CONFIGS,
        ["C", "W", "HAS_BIAS", "SILU", "IS_VARLEN"],
        _dz_grid,
        x=x,
        bias=x if bias is None else bias,
        starts=starts,
        dy=dy,
        dz=dz,
        dw_part=dw_part,
        db_part=db_part,
        group_rows=group_rows,
        HAS_BIAS=bias is not None,
        SILU=opts.silu,
        **common,
        **_dz_meta({"W": W}),
    )
    launch(
        _conv1d_bwd_dx_kernel,
        BWD_DX_CONFIGS,
        ["C", "W", "IS_VARLEN"],
        _dz_grid,
        dz=dz,
        ends=ends,
        dx=dx,
        group_rows=DX_GROUP_ROWS,
        **common,
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
    cu_seqlens_cpu: HostOffsets | None = None,
) -> torch.Tensor:
    """Depthwise causal conv1d with optional SiLU on our Triton kernels (forward and backward).

    Args:
        x: [B, T, C] activations, bf16 / fp16 / fp32 (copied when not contiguous).
        weight: [C, W] per-channel taps (tap W - 1 multiplies the current token), any float dtype.
        bias: optional [C].
        activation: "silu" (alias "swish") or None.
        cu_seqlens: optional [N+1] int32/int64 offsets of packed sequences (needs B == 1); each
            sequence starts from zero left padding; empty sequences are allowed.
        cu_seqlens_cpu: optional host copy of cu_seqlens (`ops/varlen.py`): the op then reads no offsets back
            from the device.
    Returns:
        [B, T, C] in x's dtype (math in fp32); gradients for x, weight and bias.
    Raises:
        ValueError: bad shapes, dtypes, activation or cu_seqlens, fp64 input (take the torch
            reference), or weight / bias on another device than x.
    """
    check_conv1d_inputs(x, weight, bias, activation, cu_seqlens, cu_seqlens_cpu)
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"the Triton conv1d takes bf16, fp16 or fp32 x, got {x.dtype} (use impl='torch')")
    params = [t for t in (weight, bias) if t is not None]
    if any(t.device != x.device for t in params):
        raise ValueError(f"x, weight and bias must share one device, got {[str(t.device) for t in (x, *params)]}")
    if cu_seqlens is not None and cu_seqlens.device != x.device:
        cu_seqlens = to_device(cu_seqlens, x.device)  # the kernels read the offsets
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
