"""Exact mode's routed experts. Each token copy goes through its expert's two projections by a GEMM whose
per-row result does not depend on how many tokens the expert got: `ops.linear.exact.linear_rows` per
expert on cpu (the copies combined per token in the order of its top-k slots by elementwise operations,
the reference's gradient recomputed in backward); on devices the Triton grouped GEMM pinned to one tile
config, inside the fast expert MLP where F.grouped_mm serves its backward (bf16 on cuda), else with the
fast form's gradient recomputed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common.launch import stages_fit
from ..exact import by_device, device_default, exact_forward
from ..linear.exact import linear_rows
from .grouped import grouped_mm_takes
from .grouped_gemm import BK_MAX, ROWS_CONFIGS, grouped_gemm_rows
from .mlp import experts_mlp
from .permute import moe_sort
from .reference import check_experts_inputs, empty_experts, moe_experts_ref


def exact_rows_configs() -> tuple[dict]:
    """The one tile config of every exact expert GEMM on this device, so a row's result is its own: the
    128 x 128 tiles where their stages fit in shared memory (the fastest of the row-GEMM configs at both a
    decode step's rows and a training micro-batch's: `benchmarks/exact_tiles.py`), else the smallest."""
    return (ROWS_CONFIGS[1],) if stages_fit(ROWS_CONFIGS[1], BK_MAX) else (ROWS_CONFIGS[0],)


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
    return _combine(y, topk_weight, hidden.dtype)


def _experts_grouped_rows(hidden, gate_up_proj, down_proj, topk_idx, topk_weight):
    """`moe_experts_ref`'s contract on devices, any dtype: the copies sorted by expert, two grouped GEMMs in
    the pinned tile config, the copies put back in token order and combined as on cpu."""
    N, TOPK = topk_idx.shape
    I = down_proj.shape[2]
    routing = moe_sort(topk_idx.reshape(-1), gate_up_proj.shape[0])  # no host sync: graph-capturable
    order = routing.src.long()
    fixed = list(exact_rows_configs())
    h = grouped_gemm_rows(hidden[order // TOPK], gate_up_proj.transpose(1, 2), routing.ends, fixed)
    out = grouped_gemm_rows(F.silu(h[:, :I]) * h[:, I:], down_proj.transpose(1, 2), routing.ends, fixed)
    y = torch.empty_like(out)
    y[order] = out
    return _combine(y.view(N, TOPK, -1), topk_weight, hidden.dtype)


_experts_grouped_rows_exact = exact_forward(_experts_grouped_rows, device_default("experts"))


def _experts_by_groups(hidden, gate_up_proj, down_proj, topk_idx, topk_weight):
    """`moe_experts_ref`'s contract on devices. Where F.grouped_mm takes the operands (bf16 on cuda): the
    fast expert MLP (router weight in the SwiGLU, a token's copies summed in slot order) with its forward
    GEMMs pinned to one tile config, so a row's result is that row's alone, and its own backward from the
    saved gate_up output. Elsewhere `_experts_grouped_rows`, the fast form's gradient recomputed."""
    check_experts_inputs(hidden, gate_up_proj, down_proj, topk_idx, topk_weight)
    if hidden.shape[0] == 0:
        return empty_experts(hidden, gate_up_proj, down_proj, topk_weight)
    I = down_proj.shape[2]
    if not grouped_mm_takes(hidden, hidden.shape[1], 2 * I, I):
        return _experts_grouped_rows_exact(hidden, gate_up_proj, down_proj, topk_idx, topk_weight)
    routing = moe_sort(topk_idx.reshape(-1), gate_up_proj.shape[0])
    w = topk_weight.reshape(-1).float()
    return experts_mlp(hidden, gate_up_proj, down_proj, w, routing, topk_idx.shape[1], exact_rows_configs())


def _combine(y: torch.Tensor, topk_weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum_j topk_weight[:, j] * y[:, j] over each token's copies y [N, TOPK, D], j = 0, 1, ... in order."""
    acc_dtype = torch.promote_types(y.dtype, topk_weight.dtype)
    weight = topk_weight.to(acc_dtype)
    out = y[:, 0].to(acc_dtype) * weight[:, 0, None]
    for j in range(1, y.shape[1]):
        out = out + y[:, j].to(acc_dtype) * weight[:, j, None]
    return out.to(dtype)


# the dispatched "exact" experts: per-row GEMMs forward; the reference's gradient (recomputed) on cpu, the
# fast MLP's own backward on devices
moe_experts_exact = by_device(exact_forward(_experts_by_rows, moe_experts_ref), _experts_by_groups)

__all__ = ["moe_experts_exact"]
