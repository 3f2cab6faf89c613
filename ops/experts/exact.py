"""Exact mode's routed experts. Each token copy goes through its expert's two projections by a GEMM whose
per-row result does not depend on how many tokens the expert got: `ops.linear.exact.linear_rows` per
expert on cpu (the copies combined per token in the order of its top-k slots by elementwise operations,
the reference's gradient recomputed in backward); on devices the Triton grouped GEMM in fixed tiles
(`exact_rows_configs`: one config for training sizes, fast mode's decode config at decode sizes where the
device gives both the same bits), inside the fast expert MLP where F.grouped_mm serves its backward (bf16
on cuda), else with the fast form's gradient recomputed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import device
from ..common.launch import stages_fit
from ..exact import by_device, device_default, exact_forward, tiles_agree
from ..linear.exact import linear_rows
from .grouped import grouped_mm_takes
from .grouped_gemm import BK_MAX, ROWS_CONFIGS, SMALL_ROWS_CONFIGS, SMALL_ROWS_PER_EXPERT, grouped_gemm_rows
from .mlp import experts_mlp
from .permute import moe_sort
from .reference import check_experts_inputs, empty_experts, moe_experts_ref


def exact_rows_configs(dtype: torch.dtype, copies: int, experts: int) -> tuple[dict]:
    """The tile config of the exact expert GEMMs of `dtype` operands for `copies` token copies over `experts`
    experts on this device: at a decode step's sizes (as in fast mode: at most SMALL_ROWS_PER_EXPERT copies per
    expert on average) fast mode's decode config where this device gives it the same bits; else the training
    config (`_training_rows_config`)."""
    if copies <= SMALL_ROWS_PER_EXPERT * experts and decode_tiles_agree(dtype):
        return (SMALL_ROWS_CONFIGS[0],)
    return (_training_rows_config(),)


def _training_rows_config() -> dict:
    """The 128 x 128 tiles where their stages fit in shared memory (the fastest of the row-GEMM configs at a
    training micro-batch's rows: `benchmarks/exact_tiles.py`), else the smallest."""
    return ROWS_CONFIGS[1] if stages_fit(ROWS_CONFIGS[1], BK_MAX) else ROWS_CONFIGS[0]


def decode_tiles_agree(dtype: torch.dtype) -> bool:
    """Whether the decode and training configs give the same bits on this device, on random probe rows of 4
    groups (`ops.exact.tiles_agree`, measured once)."""
    decode, training = SMALL_ROWS_CONFIGS[0], _training_rows_config()
    if dtype not in (torch.bfloat16, torch.float16) or not stages_fit(decode, BK_MAX) or decode is training:
        return False  # fp32 keeps one config (`stages_fit` counts 16-bit operands)
    dev = device.current_device()

    def outputs():
        gen = torch.Generator(dev).manual_seed(0)
        a = torch.randn(200, 512, generator=gen, device=dev).to(dtype)
        b = torch.randn(4, 512, 384, generator=gen, device=dev).to(dtype)
        ends = torch.tensor([30, 31, 150, 200], device=dev)
        return [grouped_gemm_rows(a, b, ends, [c]) for c in (training, decode)]

    key = ("grouped_gemm_rows", dtype, str(dev), *(tuple(sorted(c.items())) for c in (training, decode)))
    return tiles_agree(key, outputs)


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
    `exact_rows_configs`' tiles, the copies put back in token order and combined as on cpu."""
    N, TOPK = topk_idx.shape
    I = down_proj.shape[2]
    routing = moe_sort(topk_idx.reshape(-1), gate_up_proj.shape[0])  # no host sync: graph-capturable
    order = routing.src.long()
    fixed = list(exact_rows_configs(hidden.dtype, N * TOPK, gate_up_proj.shape[0]))
    h = grouped_gemm_rows(hidden[order // TOPK], gate_up_proj.transpose(1, 2), routing.ends, fixed)
    out = grouped_gemm_rows(F.silu(h[:, :I]) * h[:, I:], down_proj.transpose(1, 2), routing.ends, fixed)
    y = torch.empty_like(out)
    y[order] = out
    return _combine(y.view(N, TOPK, -1), topk_weight, hidden.dtype)


_experts_grouped_rows_exact = exact_forward(_experts_grouped_rows, device_default("experts"))


def _experts_by_groups(hidden, gate_up_proj, down_proj, topk_idx, topk_weight):
    """`moe_experts_ref`'s contract on devices. Where F.grouped_mm takes the operands (bf16 on cuda): the
    fast expert MLP (router weight in the SwiGLU, a token's copies summed in slot order) with its forward
    GEMMs in `exact_rows_configs`' tiles, so a row's result is that row's alone, and its own backward from the
    saved gate_up output. Elsewhere `_experts_grouped_rows`, the fast form's gradient recomputed."""
    check_experts_inputs(hidden, gate_up_proj, down_proj, topk_idx, topk_weight)
    if hidden.shape[0] == 0:
        return empty_experts(hidden, gate_up_proj, down_proj, topk_weight)
    I = down_proj.shape[2]
    if not grouped_mm_takes(hidden, hidden.shape[1], 2 * I, I):
        return _experts_grouped_rows_exact(hidden, gate_up_proj, down_proj, topk_idx, topk_weight)
    routing = moe_sort(topk_idx.reshape(-1), gate_up_proj.shape[0])
    w = topk_weight.reshape(-1).float()
    rows_configs = exact_rows_configs(hidden.dtype, w.shape[0], gate_up_proj.shape[0])
    return experts_mlp(hidden, gate_up_proj, down_proj, w, routing, topk_idx.shape[1], rows_configs)


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

__all__ = ["decode_tiles_agree", "exact_rows_configs", "moe_experts_exact"]
