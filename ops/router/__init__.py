"""Top-k softmax MoE router in an explicit dtype (fp32 by default) and its load-balancing loss.

The dispatched `router` callable is `route_ref`'s contract; "triton" (`topk.route_triton`) is the
fp32 router as one GEMM plus one softmax/top-k kernel, the default on cuda/npu.
"""

import torch

from ..dispatch import resolve
from .reference import load_balancing_loss, route_ref

IMPLS = {
    "torch": "verl_moe.ops.router.reference:route_ref",
    "triton": "verl_moe.ops.router.topk:route_triton",
    "exact": "verl_moe.ops.router.exact:route_exact",
}


def route(hidden, gate_weight, top_k: int, norm_topk_prob: bool, dtype=torch.float32, impl: str | None = None):
    """Routing through the implementation `resolve("router", impl)` picks; arguments and returns as
    `route_ref`."""
    return resolve("router", impl)(hidden, gate_weight, top_k, norm_topk_prob, dtype=dtype)


__all__ = ["IMPLS", "load_balancing_loss", "route", "route_ref"]
