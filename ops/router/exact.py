"""Exact mode's router: the router GEMM by the batch-invariant projection (`ops.linear.exact`), then the
softmax, top-k and renormalisation per row: the reference's on cpu (per row there with torch's scalar
kernels), one Triton program per token on devices (`exact_kernel.py`)."""

from __future__ import annotations

import torch

from ..exact import by_device, exact_forward
from ..linear.exact import linear_exact
from .exact_kernel import route_rows_triton
from .reference import check_route_inputs, route_logits


def _topk_torch(logits, top_k: int, norm_topk_prob: bool):
    _, topk_weight, topk_idx = route_logits(logits, top_k, norm_topk_prob)
    return topk_weight, topk_idx


def _topk_kernel(logits, top_k: int, norm_topk_prob: bool):
    _, topk_weight, topk_idx = route_rows_triton(logits, top_k, norm_topk_prob)
    return topk_weight, topk_idx


# softmax, top-k and renormalisation: per row (torch on cpu, the kernel on devices), torch's gradient
_topk_exact = exact_forward(by_device(_topk_torch, _topk_kernel), _topk_torch)


def route_exact(hidden, gate_weight, top_k: int, norm_topk_prob: bool, dtype: torch.dtype = torch.float32):
    """`route_ref`'s contract; each token's routing depends on that token alone."""
    check_route_inputs(hidden, gate_weight, top_k, dtype)
    if hidden.device.type != "cpu" and dtype != torch.float32:
        raise ValueError(f"exact mode routes in fp32 on devices (router_dtype fp32), got {dtype}")
    logits = linear_exact(hidden.to(dtype), gate_weight.to(dtype))
    topk_weight, topk_idx = _topk_exact(logits, top_k, norm_topk_prob)
    return logits, topk_weight, topk_idx


__all__ = ["route_exact"]
