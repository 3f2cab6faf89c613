"""Top-k softmax MoE router in an explicit dtype (fp32 by default) and its load-balancing loss."""

from .reference import load_balancing_loss, route_ref

IMPLS = {"torch": "verl_moe.ops.router.reference:route_ref"}

# The public op is the reference until a kernel exists; it validates before computing.
route = route_ref

__all__ = ["IMPLS", "load_balancing_loss", "route", "route_ref"]
