"""Exact mode's routed experts, in PyTorch (the CPU form). Each token copy goes through its expert's two
projections by the batch-invariant GEMM (`ops.linear.exact.linear_rows`), so its result does not depend
on how many tokens the expert got; the copies are combined per token in the order of its top-k slots.
Its gradient is the reference's (`moe_experts_ref`), recomputed in backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..exact import exact_forward
from ..linear.exact import linear_rows
from .reference import check_experts_inputs, empty_experts, moe_experts_ref


def _experts_by_rows(hidden, gate_up_proj, down_proj, topk_idx, topk_weight):
    """`moe_experts_ref`'s contract (expert GEMMs in the weights' dtype, combine in promote(hidden, weights))."""
    check_experts_inputs(hidden, gate_up_proj, down_proj, topk_idx, topk_weight)
    if hidden.shape[0] == 0:
        return empty_experts(hidden, gate_up_proj, down_proj, topk_weight)
    I = down_proj.shape[2]
    y = hidden.new_zeros(*topk_idx.shape, hidden.shape[1])  # [N, TOPK, D] each copy's expert output
    for e in torch.unique(topk_idx).tolist():
        token, slot = torch.where(topk_idx == e)
        h = linear_rows(hidden[token], gate_up_proj[e])
        y[token, slot] = linear_rows(F.silu(h[:, :I]) * h[:, I:], down_proj[e])
    acc_dtype = torch.promote_types(hidden.dtype, topk_weight.dtype)
    weight = topk_weight.to(acc_dtype)
    out = y[:, 0].to(acc_dtype) * weight[:, 0, None]
    for j in range(1, y.shape[1]):
        out = out + y[:, j].to(acc_dtype) * weight[:, j, None]
    return out.to(hidden.dtype)


# the dispatched "exact" experts: per-row GEMMs forward, the reference's gradient
moe_experts_exact = exact_forward(_experts_by_rows, moe_experts_ref)

__all__ = ["moe_experts_exact"]
