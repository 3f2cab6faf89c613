"""MoE expert MLPs over fused 3-D weights, straightforward loop over experts.

Layout is transformers' (`Qwen3_5MoeExperts` / `Qwen3MoeExperts`): gate_up_proj[e] is
[2I, D] with the gate rows first, then the up rows (checkpoints' per-expert gate_proj and
up_proj concatenated in that order); down_proj[e] is [D, I]. Expert e computes
down_proj[e] @ (silu(gate) * up). The expert GEMMs run in the weights' dtype; the combine
(weighting by the router and summing over TOPK) runs in promote(hidden dtype, topk_weight dtype),
so an fp32 router keeps fp32 combine weights even for a bf16 model.

Below it, the torch versions of the grouped pipeline's token moves (`Routing`, sort, permute, weighted
SwiGLU, unpermute): the "grouped" implementation's steps and the references of the Triton ones.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import device


def check_experts_inputs(
    hidden, gate_up_proj, down_proj, topk_idx, topk_weight, num_experts: int | None = None
) -> None:
    """Raise ValueError for shapes and dtypes the expert op cannot take. Expert ids must lie in
    [0, num_experts) (default: the experts the weights hold; more under expert parallelism): checked on the
    host (ValueError), on cuda by the device without waiting for it (a device-side assert)."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [N, D], got {tuple(hidden.shape)}")
    N, D = hidden.shape
    if gate_up_proj.dim() != 3 or gate_up_proj.shape[2] != D or gate_up_proj.shape[1] % 2:
        raise ValueError(f"gate_up_proj must be [E, 2I, D] with D={D}, got {tuple(gate_up_proj.shape)}")
    E, I = gate_up_proj.shape[0], gate_up_proj.shape[1] // 2
    if tuple(down_proj.shape) != (E, D, I):
        raise ValueError(f"down_proj must be [E, D, I] = {(E, D, I)}, got {tuple(down_proj.shape)}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != N or topk_weight.shape != topk_idx.shape:
        raise ValueError(
            f"topk_idx and topk_weight must both be [N={N}, TOPK], got {tuple(topk_idx.shape)} "
            f"and {tuple(topk_weight.shape)}"
        )
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_idx must be int32/int64, got {topk_idx.dtype}")
    if not (hidden.dtype == gate_up_proj.dtype == down_proj.dtype):
        raise ValueError(
            f"hidden, gate_up_proj, down_proj must share one dtype, got {hidden.dtype}, "
            f"{gate_up_proj.dtype}, {down_proj.dtype}"
        )
    if not topk_weight.is_floating_point():
        raise ValueError(f"topk_weight must be floating point, got {topk_weight.dtype}")
    E = E if num_experts is None else num_experts
    if not topk_idx.numel() or device.capturing():  # a graph capture cannot read values back
        return
    message = f"topk_idx values must be in [0, E={E})"
    if topk_idx.device.type == "cuda":
        # checked on the device: a host read here would stall the training step at every MoE layer until the
        # device caught up (a failure is a device-side assert with the message, reported at the next sync)
        torch._assert_async(((topk_idx >= 0) & (topk_idx < E)).all(), message)
        return
    lo, hi = torch.aminmax(topk_idx)  # one device sync
    if lo < 0 or hi >= E:
        raise ValueError(message)


class _EmptyExperts(torch.autograd.Function):
    """N = 0 tokens: the empty [0, D] output, and zero gradients for every input (no read of the weights)."""

    @staticmethod
    def forward(ctx, hidden, gate_up_proj, down_proj, topk_weight):
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in (hidden, gate_up_proj, down_proj, topk_weight)]
        return hidden.new_zeros(hidden.shape)

    @staticmethod
    def backward(ctx, _dout):
        return tuple(torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.shapes)


def empty_experts(hidden, gate_up_proj, down_proj, topk_weight) -> torch.Tensor:
    """The output for N = 0 tokens (an expert-parallel rank may receive none): [0, D], differentiable,
    with zero gradients for the weights (the graph still reaches them, so backward runs everywhere)."""
    return _EmptyExperts.apply(hidden, gate_up_proj, down_proj, topk_weight)


def moe_experts_ref(
    hidden: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
) -> torch.Tensor:
    """Routed expert MLPs, summed with the router's weights (the dispatched `experts` op).

    Args:
        hidden: [N, D] tokens.
        gate_up_proj: [E, 2I, D] fused gate (rows :I) and up (rows I:) projections.
        down_proj: [E, D, I].
        topk_idx: [N, TOPK] int expert ids.
        topk_weight: [N, TOPK] combine weights (e.g. fp32 from the router).
    Returns:
        [N, D] in hidden's dtype: sum_k topk_weight[n, k] * expert_{topk_idx[n, k]}(hidden[n]).
    Raises:
        ValueError: bad shapes, mixed hidden/weight dtypes, or expert ids out of range.
    """
    check_experts_inputs(hidden, gate_up_proj, down_proj, topk_idx, topk_weight)
    if hidden.shape[0] == 0:
        return empty_experts(hidden, gate_up_proj, down_proj, topk_weight)
    acc_dtype = torch.promote_types(hidden.dtype, topk_weight.dtype)
    out = torch.zeros(hidden.shape, dtype=acc_dtype, device=hidden.device)
    I = down_proj.shape[2]
    for e in torch.unique(topk_idx).tolist():
        token, slot = torch.where(topk_idx == e)
        h = F.linear(hidden[token], gate_up_proj[e])  # [n_e, 2I]
        y = F.linear(F.silu(h[:, :I]) * h[:, I:], down_proj[e])  # [n_e, D]
        out.index_add_(0, token, y.to(acc_dtype) * topk_weight[token, slot, None].to(acc_dtype))
    return out.to(hidden.dtype)


class Routing(NamedTuple):
    """Where the S = N * TOPK token copies go, copy c = t * TOPK + k being token t's k-th expert.

    dest: [S] int32, the row of copy c in expert-sorted order (stable: by expert, then by c).
    src: [S] int32, the copy at sorted row s (dest's inverse).
    counts: [E] int32 copies per expert.
    ends: [E] int32 cumulative counts (each expert's end row: grouped_mm's `offs`).
    """

    dest: torch.Tensor
    src: torch.Tensor
    counts: torch.Tensor
    ends: torch.Tensor


def sort_ref(ids: torch.Tensor, num_experts: int) -> Routing:
    """ids [S] expert ids in [0, E) -> `Routing` by a stable argsort (torch ops)."""
    src = torch.argsort(ids, stable=True)
    dest = torch.empty_like(src).scatter_(0, src, torch.arange(ids.numel(), device=ids.device))
    counts = torch.bincount(ids, minlength=num_experts).to(torch.int32)
    return Routing(dest.to(torch.int32), src.to(torch.int32), counts, torch.cumsum(counts, 0, dtype=torch.int32))


def permute_ref(hidden: torch.Tensor, routing: Routing, top_k: int) -> torch.Tensor:
    """hidden [N, D] -> [N * TOPK, D] copies in sorted order (row s = hidden[src[s] // TOPK])."""
    return hidden[routing.src.long() // top_k]


def unpermute_ref(ys: torch.Tensor, routing: Routing, top_k: int) -> torch.Tensor:
    """ys [N * TOPK, D] sorted rows -> [N, D], out[t] = sum_k ys[dest[t * TOPK + k]], summed in at least fp32."""
    acc = torch.promote_types(ys.dtype, torch.float32)
    return ys[routing.dest.long()].view(-1, top_k, ys.shape[1]).sum(1, dtype=acc).to(ys.dtype)


def swiglu_ref(h: torch.Tensor, w: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """w[src[s]] * silu(h[s, :I]) * h[s, I:] for h [S, 2I], w [S] the copies' router weights, src [S] the
    copy at each row; math in promote(h dtype, fp32), returned in h's dtype."""
    I = h.shape[1] // 2
    acc = torch.promote_types(h.dtype, torch.float32)
    return (F.silu(h[:, :I].to(acc)) * h[:, I:].to(acc) * w[src.long()].to(acc)[:, None]).to(h.dtype)
