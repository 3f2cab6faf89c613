"""Routed experts under expert parallelism (EP): each of the `size` ranks of an EP group holds a
contiguous block of E / size experts; a token copy travels to the rank that holds its expert and
its output travels back, with two autograd-aware all-to-alls:

    copies sorted by expert (so by owner rank) -> all-to-all -> received copies grouped by local
    expert -> grouped expert MLP -> back to arrival order -> all-to-all back -> weight by the
    router -> token order [N, TOPK, D] -> sum over TOPK

The router weights never travel: the combine happens on the token's own rank, in
promote(hidden dtype, router dtype) as in the single-rank ops. Deterministic: stable sorts,
no atomics. Works with any backend that implements `all_to_all_single` (NCCL, HCCL, gloo).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from .grouped import grouped_swiglu
from .reference import check_experts_inputs


@dataclass(frozen=True)
class ExpertParallelGroup:
    """The process group over which experts are split, this rank's index in it, and its size.

    `weight_grad_scale` multiplies the gradients of the local expert weights in backward: an
    expert's gradient sums the tokens of every rank of the group, so an engine whose gradient
    reduction averages over the other ranks only (FSDP over the expert-sharding mesh) sets
    1 / size to get the same data-parallel average as every other weight.
    """

    group: dist.ProcessGroup
    size: int
    rank: int
    weight_grad_scale: float = 1.0


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _exchange_counts(send_counts: torch.Tensor, ep: ExpertParallelGroup) -> list[int]:
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=ep.group)
    return recv_counts.tolist()


def moe_experts_expert_parallel(
    hidden: torch.Tensor,
    gate_up_local: torch.Tensor,
    down_local: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    ep: ExpertParallelGroup,
) -> torch.Tensor:
    """hidden [N, D] and topk_idx / topk_weight [N, TOPK] of this rank's tokens (global expert ids);
    gate_up_local [E / ep.size, 2I, D] and down_local [E / ep.size, D, I] are this rank's experts
    (global ids ep.rank * E_local ...). Returns [N, D] in hidden's dtype, equal to the single-rank
    op over the full weights. Every rank of the group must call it (collective)."""
    E_local = gate_up_local.shape[0]
    check_experts_inputs(hidden, gate_up_local, down_local, topk_idx, topk_weight, num_experts=E_local * ep.size)
    N, TOPK = topk_idx.shape
    flat_idx = topk_idx.reshape(-1)
    order = torch.argsort(flat_idx, stable=True)
    sorted_idx = flat_idx[order]
    owner = torch.div(sorted_idx, E_local, rounding_mode="floor")
    send_counts = torch.bincount(owner, minlength=ep.size)
    send_split = send_counts.tolist()
    recv_split = _exchange_counts(send_counts, ep)

    # expert ids travel without autograd; token rows with it
    local_ids = (sorted_idx - owner * E_local).to(torch.int64)
    recv_ids = local_ids.new_empty(sum(recv_split))
    dist.all_to_all_single(recv_ids, local_ids, recv_split, send_split, group=ep.group)
    rows = hidden[order // TOPK]
    recv_rows = all_to_all_single_autograd(rows, recv_split, send_split, ep.group)

    # rows from each source arrive sorted by expert within the source's block: regroup by expert
    if ep.weight_grad_scale != 1.0:
        gate_up_local = _ScaleGrad.apply(gate_up_local, ep.weight_grad_scale)
        down_local = _ScaleGrad.apply(down_local, ep.weight_grad_scale)
    by_expert = torch.argsort(recv_ids, stable=True)
    offsets = torch.bincount(recv_ids, minlength=E_local).cumsum(0).to(torch.int32)
    out_grouped = grouped_swiglu(recv_rows[by_expert], gate_up_local, down_local, offsets)
    out_arrival = torch.empty_like(out_grouped).index_copy(0, by_expert, out_grouped)

    out_sorted = all_to_all_single_autograd(out_arrival, send_split, recv_split, ep.group)
    acc_dtype = torch.promote_types(hidden.dtype, topk_weight.dtype)
    weighted = out_sorted.to(acc_dtype) * topk_weight.reshape(-1)[order, None].to(acc_dtype)
    unsorted = torch.empty_like(weighted).index_copy(0, order, weighted)
    return unsorted.view(N, TOPK, -1).sum(1).to(hidden.dtype)
