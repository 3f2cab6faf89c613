"""Gated delta rule (the linear attention of Qwen3.5's GatedDeltaNet layers).

`chunk_gated_delta_rule` dispatches (see `ops/dispatch.py`): our Triton kernels (`chunk.py`) on
cuda/npu, the PyTorch reference on cpu, fla when asked for; `VERL_MOE_OPS` overrides.
"""

import functools
import inspect

import torch

from ..dispatch import resolve
from .reference import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref

IMPLS = {
    "torch": "verl_moe.ops.gdn.reference:chunk_gated_delta_rule_ref",
    "triton": "verl_moe.ops.gdn.chunk:chunk_gated_delta_rule",
    "fla": "verl_moe.ops.gdn:fla_chunk_gated_delta_rule",
    "exact": "verl_moe.ops.gdn.exact:recurrent_gated_delta_rule_exact",
}


@functools.cache
def _fla_takes_host_offsets() -> bool:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return "cu_seqlens_cpu" in inspect.signature(chunk_gated_delta_rule).parameters


def fla_chunk_gated_delta_rule(*args, cu_seqlens_cpu=None, **kwargs):
    """fla's `chunk_gated_delta_rule`; the host offsets go along where this fla version takes them
    (`cu_seqlens_cpu`, the same name), else fla reads `cu_seqlens` itself."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    if cu_seqlens_cpu is not None and _fla_takes_host_offsets():
        kwargs["cu_seqlens_cpu"] = torch.as_tensor(cu_seqlens_cpu, dtype=torch.long)  # fla's type
    return chunk_gated_delta_rule(*args, **kwargs)


def chunk_gated_delta_rule(*args, impl: str | None = None, **kwargs):
    """Gated delta rule through the implementation `resolve("gdn", impl)` picks; arguments and
    returns as `chunk_gated_delta_rule_ref` (the triton one also takes the in-kernel gate)."""
    return resolve("gdn", impl)(*args, **kwargs)


__all__ = [
    "IMPLS",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_ref",
    "fla_chunk_gated_delta_rule",
    "recurrent_gated_delta_rule_ref",
]
