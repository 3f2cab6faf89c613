"""Routed MoE expert MLPs over transformers' fused [E, 2I, D] / [E, D, I] weights."""

from ..dispatch import resolve
from .reference import moe_experts_ref

IMPLS = {
    "torch": "verl_moe.ops.experts.reference:moe_experts_ref",
    "grouped": "verl_moe.ops.experts.grouped:moe_experts_grouped",
}
# On cuda/npu the grouped-GEMM path is the default: one GEMM per projection instead of E.
ACCELERATOR_DEFAULT = "grouped"


def moe_experts(hidden, gate_up_proj, down_proj, topk_idx, topk_weight, impl: str | None = None):
    """Routed experts through the implementation `resolve("experts", impl)` picks; arguments and
    returns as `moe_experts_ref`."""
    return resolve("experts", impl)(hidden, gate_up_proj, down_proj, topk_idx, topk_weight)


__all__ = ["ACCELERATOR_DEFAULT", "IMPLS", "moe_experts", "moe_experts_ref"]
