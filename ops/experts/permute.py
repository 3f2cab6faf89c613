"""Token movement of the routed experts in Triton: a stable counting sort of the N * TOPK token copies
by expert, the scatter of token rows to their sorted slots, and the gather-sum back per token.

Sort (three launches and one torch cumsum over E, deterministic, no atomics): per block of BS copies,
a histogram over the experts ([E, n_blocks] int32); per expert, an exclusive scan over the blocks;
then each copy's slot = first slot of its expert + its expert's copies in earlier blocks + its
expert's earlier copies in its own block. Same order as a stable argsort of the expert ids.

Rows: `scatter_rows` writes x[t] to the TOPK slots dest[t, :] ([N, D] -> [N * TOPK, D]), reading each
token row once; `gather_sum` sums the TOPK slot rows of each token in fp32 ([N * TOPK, D] -> [N, D]).
Each is the other's backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..common.launch import cdiv, grid_1d, launch, next_pow2
from .reference import Routing

# Copies per block of the sort (a power of two): the [BS, BS] rank tile of the scatter kernel.
SORT_BS = 64
SORT_HIST_CONFIGS = [{"BEC": 64, "num_warps": 4}]
SORT_SCAN_CONFIGS = [{"BB": 1024, "num_warps": 4}]
SORT_SCATTER_CONFIGS = [{"num_warps": 4}]
# Token rows per program and the row chunk; the first config is what the interpreter and deterministic
# mode run (these kernels only move data and sum TOPK rows in a fixed order: every config gives the
# same bits).
ROWS_CONFIGS = [
    {"BT": 1, "BD": 1024, "num_warps": 4},
    {"BT": 2, "BD": 1024, "num_warps": 8},
    {"BT": 4, "BD": 512, "num_warps": 4},
    {"BT": 1, "BD": 2048, "num_warps": 8},
]


@triton.jit(do_not_specialize=["n_copies", "n_blocks"])
def _moe_sort_hist_kernel(
    ids, hist, n_copies, n_blocks, E: tl.constexpr, BE: tl.constexpr, BEC: tl.constexpr, BS: tl.constexpr
):
    """One program per block of BS copies (1-D grid, looping): hist[e, blk] = copies of the block
    routed to expert e, int32 [E, n_blocks]; experts in chunks of BEC."""
    i_p = tl.program_id(0)
    o_c = tl.arange(0, BEC)
    for i_blk in range(i_p, n_blocks, tl.num_programs(0)):
        o_s = i_blk * BS + tl.arange(0, BS)
        b_e = tl.load(ids + o_s, mask=o_s < n_copies, other=-1).to(tl.int32)
        for i_e in range(0, BE, BEC):
            b_n = tl.sum((b_e[:, None] == (i_e + o_c)[None, :]).to(tl.int32), 0)
            tl.store(hist + (i_e + o_c) * n_blocks + i_blk, b_n, mask=(i_e + o_c) < E)


@triton.jit(do_not_specialize=["n_blocks"])
def _moe_sort_scan_kernel(hist, base, counts, n_blocks, E: tl.constexpr, BB: tl.constexpr):
    """One program per expert (1-D grid, looping): base[e, blk] = copies routed to e in the blocks
    before blk (exclusive scan of hist[e, :]), counts[e] = all of them, int32."""
    i_p = tl.program_id(0)
    o_b = tl.arange(0, BB)
    for i_e in range(i_p, E, tl.num_programs(0)):
        b_carry = tl.full([], 0, dtype=tl.int32)
        row = i_e * n_blocks  # int32: E * n_blocks < 2^31 at the documented maxima
        for i_b in range(0, n_blocks, BB):
            m = (i_b + o_b) < n_blocks
            b_h = tl.load(hist + row + i_b + o_b, mask=m, other=0)
            tl.store(base + row + i_b + o_b, tl.cumsum(b_h, 0) - b_h + b_carry, mask=m)
            b_carry += tl.sum(b_h, 0)
        tl.store(counts + i_e, b_carry)


@triton.jit(do_not_specialize=["n_copies", "n_blocks"])
def _moe_sort_scatter_kernel(ids, counts, ends, base, dest, src, n_copies, n_blocks, BS: tl.constexpr):
    """One program per block of BS copies (1-D grid, looping): dest[c] = (ends - counts)[e] + base[e, blk]
    + earlier copies of e in the block, for c's expert e; src[dest[c]] = c (the inverse permutation)."""
    i_p = tl.program_id(0)
    o_i = tl.arange(0, BS)
    for i_blk in range(i_p, n_blocks, tl.num_programs(0)):
        o_s = i_blk * BS + o_i
        m_s = o_s < n_copies
        b_e = tl.load(ids + o_s, mask=m_s, other=0).to(tl.int32)
        b_rank = tl.sum(((b_e[None, :] == b_e[:, None]) & (o_i[None, :] < o_i[:, None])).to(tl.int32), 1)
        b_start = tl.load(ends + b_e, mask=m_s, other=0) - tl.load(counts + b_e, mask=m_s, other=0)
        b_base = tl.load(base + b_e.to(tl.int64) * n_blocks + i_blk, mask=m_s, other=0)
        b_dst = b_start + b_base + b_rank
        tl.store(dest + o_s, b_dst, mask=m_s)
        tl.store(src + b_dst, o_s, mask=m_s)


@triton.jit(do_not_specialize=["n_tokens"])
def _moe_scatter_rows_kernel(
    x, dest, xs, n_tokens, D: tl.constexpr, TOPK: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr
):
    """One program per block of BT tokens (1-D grid, looping): xs[dest[t, k]] = x[t] for k < TOPK,
    rows of D in chunks of BD (x read once)."""
    i_p = tl.program_id(0)
    for i_blk in range(i_p, tl.cdiv(n_tokens, BT), tl.num_programs(0)):
        o_t = (i_blk * BT + tl.arange(0, BT)).to(tl.int64)
        m_t = o_t < n_tokens
        for i_d in range(0, D, BD):
            o_d = i_d + tl.arange(0, BD)
            m = m_t[:, None] & (o_d < D)[None, :]
            b_x = tl.load(x + o_t[:, None] * D + o_d[None, :], mask=m, other=0.0)
            for i_k in range(TOPK):
                b_dst = tl.load(dest + o_t * TOPK + i_k, mask=m_t, other=0).to(tl.int64)
                tl.store(xs + b_dst[:, None] * D + o_d[None, :], b_x, mask=m)


@triton.jit(do_not_specialize=["n_tokens"])
def _moe_gather_sum_kernel(
    xs, dest, out, n_tokens, D: tl.constexpr, TOPK: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr
):
    """One program per block of BT tokens (1-D grid, looping): out[t] = sum_k xs[dest[t, k]], summed in
    fp32 in the order k = 0 .. TOPK-1, stored in out's dtype."""
    i_p = tl.program_id(0)
    for i_blk in range(i_p, tl.cdiv(n_tokens, BT), tl.num_programs(0)):
        o_t = (i_blk * BT + tl.arange(0, BT)).to(tl.int64)
        m_t = o_t < n_tokens
        for i_d in range(0, D, BD):
            o_d = i_d + tl.arange(0, BD)
            m = m_t[:, None] & (o_d < D)[None, :]
            b_acc = tl.zeros([BT, BD], dtype=tl.float32)
            for i_k in range(TOPK):
                b_src = tl.load(dest + o_t * TOPK + i_k, mask=m_t, other=0).to(tl.int64)
                b_acc += tl.load(xs + b_src[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
            tl.store(out + o_t[:, None] * D + o_d[None, :], b_acc.to(out.dtype.element_ty), mask=m)


def _sort_meta(shape: dict) -> dict:
    return {"BE": next_pow2(shape["E"], lo=64), "BS": SORT_BS}


def _sort_runtime(shape: dict) -> dict:
    n_copies = shape["N"] * shape["TOPK"]
    return {"n_copies": n_copies, "n_blocks": cdiv(n_copies, SORT_BS)}


def _blocks_grid(meta: dict) -> tuple[int]:
    return grid_1d(meta["n_blocks"])


def _experts_grid(meta: dict) -> tuple[int]:
    return grid_1d(meta["E"])


def _rows_meta(shape: dict) -> dict:
    return {}


def _rows_runtime(shape: dict) -> dict:
    return {"n_tokens": shape["N"]}


def _rows_grid(meta: dict) -> tuple[int]:
    return grid_1d(cdiv(meta["n_tokens"], meta["BT"]))


MAX_SHAPES = ({"N": 1 << 20, "TOPK": 16, "E": 512, "D": 8192}, {"N": 16384, "TOPK": 8, "E": 256, "D": 2048})
_SORT = {"meta": _sort_meta, "runtime": _sort_runtime, "max_shapes": MAX_SHAPES}
_ROWS = {"configs": ROWS_CONFIGS, "meta": _rows_meta, "runtime": _rows_runtime, "grid": _rows_grid}
KERNEL_LAUNCHES = {
    "_moe_sort_hist_kernel": {**_SORT, "configs": SORT_HIST_CONFIGS, "grid": _blocks_grid},
    "_moe_sort_scan_kernel": {**_SORT, "configs": SORT_SCAN_CONFIGS, "grid": _experts_grid},
    "_moe_sort_scatter_kernel": {**_SORT, "configs": SORT_SCATTER_CONFIGS, "grid": _blocks_grid},
    "_moe_scatter_rows_kernel": {**_ROWS, "max_shapes": MAX_SHAPES},
    "_moe_gather_sum_kernel": {**_ROWS, "max_shapes": MAX_SHAPES},
}


def moe_sort(ids: torch.Tensor, num_experts: int) -> Routing:
    """ids [S] int32/int64 expert ids in [0, E) (not checked here) -> `Routing` (int32 tensors): the
    stable counting sort of the copies by expert."""
    S = ids.shape[0]
    dev = ids.device
    dest = torch.empty(S, dtype=torch.int32, device=dev)
    src = torch.empty(S, dtype=torch.int32, device=dev)
    if S == 0:
        counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
        return Routing(dest, src, counts, counts.clone())
    counts = torch.empty(num_experts, dtype=torch.int32, device=dev)  # every expert's program writes it
    ids = ids.contiguous()
    n_blocks = cdiv(S, SORT_BS)
    meta = _sort_meta({"E": num_experts})
    hist = torch.empty(num_experts, n_blocks, dtype=torch.int32, device=dev)
    sizes = {"n_copies": S, "n_blocks": n_blocks}
    launch(
        _moe_sort_hist_kernel,
        SORT_HIST_CONFIGS,
        ["E"],
        _blocks_grid,
        ids=ids,
        hist=hist,
        E=num_experts,
        **sizes,
        **meta,
    )
    base = torch.empty_like(hist)
    launch(
        _moe_sort_scan_kernel, SORT_SCAN_CONFIGS, ["E"], _experts_grid, hist=hist, base=base, counts=counts,
        n_blocks=n_blocks, E=num_experts,
    )  # fmt: skip
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    launch(
        _moe_sort_scatter_kernel, SORT_SCATTER_CONFIGS, [], _blocks_grid, ids=ids, counts=counts, ends=ends,
        base=base, dest=dest, src=src, BS=SORT_BS, **sizes,
    )  # fmt: skip
    return Routing(dest, src, counts, ends)


def scatter_rows(x: torch.Tensor, dest: torch.Tensor, top_k: int) -> torch.Tensor:
    """x [N, D] contiguous, dest [N * TOPK] int32 -> xs [N * TOPK, D] with xs[dest[t * TOPK + k]] = x[t]."""
    N, D = x.shape
    xs = torch.empty(N * top_k, D, dtype=x.dtype, device=x.device)
    if N > 0:
        launch(
            _moe_scatter_rows_kernel, ROWS_CONFIGS, ["D", "TOPK"], _rows_grid, x=x, dest=dest, xs=xs, n_tokens=N,
            D=D, TOPK=top_k,
        )  # fmt: skip
    return xs


def gather_sum(xs: torch.Tensor, dest: torch.Tensor, top_k: int) -> torch.Tensor:
    """xs [N * TOPK, D] contiguous, dest [N * TOPK] int32 -> [N, D] in xs's dtype, sum_k xs[dest[t * TOPK + k]]
    accumulated in fp32."""
    S, D = xs.shape
    N = S // top_k
    out = torch.empty(N, D, dtype=xs.dtype, device=xs.device)
    if N > 0:
        launch(
            _moe_gather_sum_kernel, ROWS_CONFIGS, ["D", "TOPK"], _rows_grid, xs=xs, dest=dest, out=out, n_tokens=N,
            D=D, TOPK=top_k,
        )  # fmt: skip
    return out


@dataclass(frozen=True)
class _Rows:
    top_k: int


class MoePermuteFunction(torch.autograd.Function):
    """hidden [N, D] -> its TOPK copies in expert-sorted order [N * TOPK, D]; backward sums each token's
    copy gradients (fp32). Saves only the int32 slots."""

    @staticmethod
    def forward(ctx, hidden, dest, opts: _Rows):
        ctx.save_for_backward(dest)
        ctx.opts = opts
        return scatter_rows(hidden, dest, opts.top_k)

    @staticmethod
    def backward(ctx, dxs):
        (dest,) = ctx.saved_tensors
        return gather_sum(dxs.contiguous(), dest, ctx.opts.top_k), None, None


class MoeUnpermuteFunction(torch.autograd.Function):
    """Expert outputs [N * TOPK, D] in sorted order -> [N, D], each token's TOPK rows summed in fp32;
    backward copies each token's gradient to its TOPK rows. Saves only the int32 slots."""

    @staticmethod
    def forward(ctx, ys, dest, opts: _Rows):
        ctx.save_for_backward(dest)
        ctx.opts = opts
        return gather_sum(ys, dest, opts.top_k)

    @staticmethod
    def backward(ctx, dout):
        (dest,) = ctx.saved_tensors
        return scatter_rows(dout.contiguous(), dest, ctx.opts.top_k), None, None


def permute_triton(hidden: torch.Tensor, routing: Routing, top_k: int) -> torch.Tensor:
    """hidden [N, D] -> [N * TOPK, D], row routing.dest[t * TOPK + k] = hidden[t] (autograd-aware)."""
    return MoePermuteFunction.apply(hidden.contiguous(), routing.dest, _Rows(top_k))


def unpermute_triton(ys: torch.Tensor, routing: Routing, top_k: int) -> torch.Tensor:
    """ys [N * TOPK, D] sorted rows -> [N, D], out[t] = sum_k ys[routing.dest[t * TOPK + k]] (autograd-aware)."""
    return MoeUnpermuteFunction.apply(ys.contiguous(), routing.dest, _Rows(top_k))
