"""Gated delta rule (the linear attention of Qwen3.5's GatedDeltaNet layers).

`chunk_gated_delta_rule` dispatches (see `ops/dispatch.py`): our Triton kernels (`chunk.py`) on
cuda/npu, the PyTorch reference on cpu, fla when asked for; `VERL_MOE_OPS` overrides.
"""

from ..dispatch import resolve
from .reference import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref

IMPLS = {
    "torch": "verl_moe.ops.gdn.reference:chunk_gated_delta_rule_ref",
    "triton": "verl_moe.ops.gdn.chunk:chunk_gated_delta_rule",
    "fla": "fla.ops.gated_delta_rule:chunk_gated_delta_rule",
}


def chunk_gated_delta_rule(*args, impl: str | None = None, **kwargs):
    """Gated delta rule through the implementation `resolve("gdn", impl)` picks; arguments and
    returns as `chunk_gated_delta_rule_ref` (the triton one also takes the in-kernel gate)."""
    return resolve("gdn", impl)(*args, **kwargs)


__all__ = ["IMPLS", "chunk_gated_delta_rule", "chunk_gated_delta_rule_ref", "recurrent_gated_delta_rule_ref"]
