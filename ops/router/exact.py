"""Exact mode's router, in PyTorch (the CPU form): the router GEMM by the batch-invariant projection
(`ops.linear.exact`), then the reference's softmax and top-k, which are per row already."""

from __future__ import annotations

import torch

from ..linear.exact import linear_exact
from .reference import check_route_inputs, route_logits


def route_exact(hidden, gate_weight, top_k: int, norm_topk_prob: bool, dtype: torch.dtype = torch.float32):
    """`route_ref`'s contract; each token's routing depends on that token alone."""
    check_route_inputs(hidden, gate_weight, top_k, dtype)
    return route_logits(linear_exact(hidden.to(dtype), gate_weight.to(dtype)), top_k, norm_topk_prob)


__all__ = ["route_exact"]
