"""Routed experts as two grouped GEMMs over expert-sorted token copies (no per-expert launches,
no atomics: the combine is a gather back to [N, TOPK] and a sum, so results are deterministic).

    copies sorted by expert -> grouped GEMM gate_up -> silu(gate) * up -> grouped GEMM down
    -> weight by the router -> back to token order [N, TOPK, D] -> sum over TOPK

The grouped GEMM is `torch.nn.functional.grouped_mm` (CUDA sm80+, CPU) where it takes the dtype
and strides; otherwise (fp64, rows not 16-byte aligned, NPU) a loop over the expert segments.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import check_experts_inputs


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not hasattr(F, "grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if x.device.type not in ("cuda", "cpu"):  # torch_npu has no grouped_mm kernel: segment loop there
        return False
    row_bytes = x.element_size()
    # grouped_mm needs 16-byte aligned strides on every operand.
    return all((d * row_bytes) % 16 == 0 for d in (x.shape[-1], w.shape[-1], w.shape[-2]))


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x: [S, IN] rows sorted by group; weight: [E, OUT, IN]; offsets: [E] int32 cumulative row ends.
    Returns [S, OUT]: row s of group e is x[s] @ weight[e].T."""
    w_t = weight.transpose(-2, -1)  # [E, IN, OUT]
    if x.shape[0] == 0:  # no rows (an expert-parallel rank that received no tokens): keep a weight gradient
        return x @ w_t[0] + 0 * weight.sum()
    if _grouped_mm_ok(x, weight):
        return F.grouped_mm(x, w_t, offs=offsets)
    ends = offsets.tolist()
    starts = [0] + ends[:-1]
    return torch.cat([x[s:e] @ w_t[g] for g, (s, e) in enumerate(zip(starts, ends))], dim=0)


def grouped_swiglu(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, offsets: torch.Tensor):
    """The expert MLP down(silu(gate) * up) of rows x [S, D] sorted by expert (`offsets` as in
    `grouped_linear`) -> [S, D]."""
    I = down_proj.shape[2]
    h = grouped_linear(x, gate_up_proj, offsets)
    return grouped_linear(F.silu(h[:, :I]) * h[:, I:], down_proj, offsets)


def moe_experts_grouped(
    hidden: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
) -> torch.Tensor:
    """Same contract as `moe_experts_ref`: hidden [N, D], gate_up_proj [E, 2I, D], down_proj
    [E, D, I], topk_idx / topk_weight [N, TOPK] -> [N, D] in hidden's dtype; the combine runs in
    promote(hidden dtype, topk_weight dtype)."""
    check_experts_inputs(hidden, gate_up_proj, down_proj, topk_idx, topk_weight)
    N, TOPK = topk_idx.shape
    E = gate_up_proj.shape[0]
    flat_idx = topk_idx.reshape(-1)
    order = torch.argsort(flat_idx, stable=True)  # stable: a fixed order for equal expert ids
    counts = torch.bincount(flat_idx, minlength=E)
    offsets = counts.cumsum(0).to(torch.int32)
    y = grouped_swiglu(hidden[order // TOPK], gate_up_proj, down_proj, offsets)  # [N*TOPK, D], grouped by expert
    acc_dtype = torch.promote_types(hidden.dtype, topk_weight.dtype)
    y = y.to(acc_dtype) * topk_weight.reshape(-1)[order, None].to(acc_dtype)
    unsorted = torch.empty_like(y).index_copy_(0, order, y)  # a permutation: no two writes collide
    return unsorted.view(N, TOPK, -1).sum(1).to(hidden.dtype)
