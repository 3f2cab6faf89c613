"""MoE expert MLPs over fused 3-D weights, straightforward loop over experts.

Layout is transformers' (`Qwen3_5MoeExperts` / `Qwen3MoeExperts`): gate_up_proj[e] is
[2I, D] with the gate rows first, then the up rows (checkpoints' per-expert gate_proj and
up_proj concatenated in that order); down_proj[e] is [D, I]. Expert e computes
down_proj[e] @ (silu(gate) * up). The expert GEMMs run in the weights' dtype; the combine
(weighting by the router and summing over TOPK) runs in promote(hidden dtype, topk_weight dtype),
so an fp32 router keeps fp32 combine weights even for a bf16 model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_experts_inputs(
    hidden, gate_up_proj, down_proj, topk_idx, topk_weight, num_experts: int | None = None
) -> None:
    """Raise ValueError for shapes and dtypes the expert op cannot take. Expert ids must lie in
    [0, num_experts) (default: the experts the weights hold; more under expert parallelism)."""
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
    if topk_idx.numel() and (topk_idx.min() < 0 or topk_idx.max() >= E):
        raise ValueError(f"topk_idx values must be in [0, E={E})")


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
    acc_dtype = torch.promote_types(hidden.dtype, topk_weight.dtype)
    out = torch.zeros(hidden.shape, dtype=acc_dtype, device=hidden.device)
    I = down_proj.shape[2]
    for e in torch.unique(topk_idx).tolist():
        token, slot = torch.where(topk_idx == e)
        h = F.linear(hidden[token], gate_up_proj[e])  # [n_e, 2I]
        y = F.linear(F.silu(h[:, :I]) * h[:, I:], down_proj[e])  # [n_e, D]
        out.index_add_(0, token, y.to(acc_dtype) * topk_weight[token, slot, None].to(acc_dtype))
    return out.to(hidden.dtype)
