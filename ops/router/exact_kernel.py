"""Exact mode's routing after the router GEMM, on devices: softmax over the experts, top-k and the
renormalised combine weights of one token in one program, by reductions of one fixed shape (torch's
softmax, top-k and sum kernels pick their launch by the shape of the call)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.launch import grid_1d, launch, next_pow2

CONFIG = {"num_warps": 1}
MAX_SHAPES = ({"N": 1 << 20, "E": 512, "TOPK": 16},)


@triton.jit(do_not_specialize=["N"])
def _route_rows_kernel(
    logits,
    topk_weight,
    topk_idx,
    N,
    E: tl.constexpr,
    BE: tl.constexpr,
    TOPK: tl.constexpr,
    BT: tl.constexpr,
    NORM: tl.constexpr,
):
    """Per row of logits [N, E] fp32: probs = softmax; the TOPK largest (ties to the lower expert id) in
    descending order, divided by their sum (added largest first) when NORM."""
    i_p, n_p = tl.program_id(0), tl.num_programs(0)
    o_e = tl.arange(0, BE)
    o_t = tl.arange(0, BT)
    for i_n in range(i_p, N, n_p):
        b_x = tl.load(logits + tl.cast(i_n, tl.int64) * E + o_e, mask=o_e < E, other=float("-inf"))
        b_e = tl.exp(b_x - tl.max(b_x, 0))
        b_p = b_e / tl.sum(b_e, 0)
        b_w = tl.zeros([BT], dtype=tl.float32)
        b_i = tl.zeros([BT], dtype=tl.int64)
        b_total = 0.0
        for j in tl.static_range(TOPK):
            b_best = tl.max(b_p, 0)
            b_at = tl.min(tl.where(b_p == b_best, o_e, BE), 0)
            b_w = tl.where(o_t == j, b_best, b_w)
            b_i = tl.where(o_t == j, b_at.to(tl.int64), b_i)
            b_total += b_best
            b_p = tl.where(o_e == b_at, -1.0, b_p)
        if NORM:
            b_w = b_w / b_total
        tl.store(topk_weight + tl.cast(i_n, tl.int64) * TOPK + o_t, b_w, mask=o_t < TOPK)
        tl.store(topk_idx + tl.cast(i_n, tl.int64) * TOPK + o_t, b_i, mask=o_t < TOPK)


KERNEL_LAUNCHES = {
    "_route_rows_kernel": {
        "configs": [CONFIG],
        "meta": lambda shape: {"BE": next_pow2(shape["E"]), "BT": next_pow2(shape["TOPK"], 2)},
        "grid": lambda meta: grid_1d(meta["N"]),
        "runtime": lambda shape: {},
        "max_shapes": MAX_SHAPES,
    },
}


def route_rows_triton(logits: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """`reference.route_logits`'s contract for fp32 logits [N, E]: (logits, topk_weight [N, TOPK] fp32,
    topk_idx [N, TOPK] int64)."""
    if logits.dtype != torch.float32:
        raise ValueError(f"the Triton exact router takes fp32 logits, got {logits.dtype}")
    logits = logits.contiguous()
    N, E = logits.shape
    topk_weight = torch.empty(N, top_k, dtype=torch.float32, device=logits.device)
    topk_idx = torch.empty(N, top_k, dtype=torch.int64, device=logits.device)
    if N:
        launch(
            _route_rows_kernel,
            [CONFIG],
            ["E", "TOPK", "NORM"],
            lambda meta: grid_1d(N),
            logits=logits,
            topk_weight=topk_weight,
            topk_idx=topk_idx,
            N=N,
            E=E,
            BE=next_pow2(E),
            TOPK=top_k,
            BT=next_pow2(top_k, 2),
            NORM=bool(norm_topk_prob),
        )
    return logits, topk_weight, topk_idx


__all__ = ["route_rows_triton"]
