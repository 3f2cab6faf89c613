"""Routed experts under expert parallelism (EP): each of the `size` ranks of an EP group holds a
contiguous block of E / size experts; a token copy travels to the rank that holds its expert and
its output travels back, with autograd-aware all-to-alls:

    sort the copies by expert (so by owner rank) -> permute token rows to that order -> all-to-all
    (rows, local expert ids, router weights) -> the local experts: the dispatched experts op over the
    received rows with TOPK = 1 (it sorts them by local expert, weights them, and returns them in
    arrival order) -> all-to-all back -> each token's TOPK rows summed (fp32)

The sort, the permutation and the sum are the token moves of the experts implementation in use
(`grouped.token_moves_for`): the Triton kernels with "triton", torch ops otherwise. Weighted rows come
back, so the sum needs no weights and the [S, D] outputs are not saved for the weights' gradient.
Deterministic: stable sorts, no atomics. Works with any backend that implements `all_to_all_single`
(NCCL, HCCL, gloo).

The group `ep` is taken by duck type (`group`, `size`, `rank`, `weight_grad_scale`: the model layer's
`verl_moe.models.process_groups.ExpertParallelGroup`), so this op imports nothing above ops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..dispatch import resolve
from .grouped import token_moves_for
from .reference import check_experts_inputs


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class _AllToAll(torch.autograd.Function):
    """Autograd-aware all_to_all_single on dim 0 with plain tensors out (the functional collectives
    return lazy wrapper tensors, which Triton kernels cannot read); backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv_split: list[int], send_split: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (send_split, recv_split), group
        out = x.new_empty((sum(recv_split), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_split, send_split, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, *ctx.splits, ctx.group), None, None, None


def _exchange_counts(send_counts: torch.Tensor, ep: Any) -> list[int]:
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=ep.group)
    return recv_counts.tolist()


def moe_experts_expert_parallel(
    hidden: torch.Tensor,
    gate_up_local: torch.Tensor,
    down_local: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    ep: Any,
    experts: Callable | None = None,
) -> torch.Tensor:
    """hidden [N, D] (N may be 0) and topk_idx / topk_weight [N, TOPK] of this rank's tokens (global
    expert ids); gate_up_local [E / ep.size, 2I, D] and down_local [E / ep.size, D, I] are this rank's
    experts (global ids ep.rank * E_local ...). `experts`: the dispatched experts callable for the
    local experts (`moe_experts_ref`'s contract; default `resolve("experts")`), whose token moves
    this op uses too. Returns [N, D] in hidden's dtype, equal to the single-rank op over the full
    weights. Every rank of the group must call it (collective). Raises ValueError (before any
    communication) as `check_experts_inputs`."""
    E_local = gate_up_local.shape[0]
    check_experts_inputs(hidden, gate_up_local, down_local, topk_idx, topk_weight, num_experts=E_local * ep.size)
    experts = resolve("experts") if experts is None else experts
    moves = token_moves_for(experts)
    N, TOPK = topk_idx.shape
    flat_idx = topk_idx.reshape(-1)
    routing = moves.sort(flat_idx, E_local * ep.size)
    send_counts = routing.counts.view(ep.size, E_local).sum(1)
    send_split = send_counts.tolist()
    recv_split = _exchange_counts(send_counts, ep)

    # expert ids travel without autograd; token rows and router weights with it
    src = routing.src.long()
    local_ids = flat_idx[src] % E_local
    recv_ids = local_ids.new_empty(sum(recv_split))
    dist.all_to_all_single(recv_ids, local_ids, recv_split, send_split, group=ep.group)
    weight = topk_weight.reshape(-1)
    weight = weight if weight.dtype == torch.float64 else weight.float()
    recv_weight = _AllToAll.apply(weight[src], recv_split, send_split, ep.group)
    rows = moves.permute(hidden, routing, TOPK)
    recv_rows = _AllToAll.apply(rows, recv_split, send_split, ep.group)

    if ep.weight_grad_scale != 1.0:
        gate_up_local = _ScaleGrad.apply(gate_up_local, ep.weight_grad_scale)
        down_local = _ScaleGrad.apply(down_local, ep.weight_grad_scale)
    out_arrival = experts(recv_rows, gate_up_local, down_local, recv_ids[:, None], recv_weight[:, None])
    out_sorted = _AllToAll.apply(out_arrival, send_split, recv_split, ep.group)
    return moves.unpermute(out_sorted, routing, TOPK)
