"""Routed MoE expert MLPs over transformers' fused [E, 2I, D] / [E, D, I] weights.

Implementations (all `moe_experts_ref`'s contract): "torch" (a loop over experts, the golden),
"grouped" (two grouped GEMMs, token moves in torch: argsort and indexing), "triton" (the same GEMMs,
token moves and the weighted SwiGLU as Triton kernels: `grouped.py`). The expert-parallel op
(`expert_parallel.py`) takes one of them for its local experts.
"""

from ..dispatch import resolve
from .reference import moe_experts_ref

IMPLS = {
    "torch": "verl_moe.ops.experts.reference:moe_experts_ref",
    "grouped": "verl_moe.ops.experts.grouped:moe_experts_grouped",
    "triton": "verl_moe.ops.experts.grouped:moe_experts_triton",
    "exact": "verl_moe.ops.experts.exact:moe_experts_exact",
}
# On cuda/npu the grouped-GEMM path with the Triton token moves is the default: one GEMM per
# projection instead of E, and the sort / permutation / activation as a few kernels.
ACCELERATOR_DEFAULT = "triton"


def moe_experts(hidden, gate_up_proj, down_proj, topk_idx, topk_weight, impl: str | None = None):
    """Routed experts through the implementation `resolve("experts", impl)` picks; arguments and
    returns as `moe_experts_ref`."""
    return resolve("experts", impl)(hidden, gate_up_proj, down_proj, topk_idx, topk_weight)


__all__ = ["ACCELERATOR_DEFAULT", "IMPLS", "moe_experts", "moe_experts_ref"]
