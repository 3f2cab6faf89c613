"""Sampling one token per row from logits at a temperature, with the processed log-prob of the token:
the rollout's per-step draw when no row filters its distribution (top-k / top-p / min-p / penalty).

`sample_tokens` resolves the implementation (`dispatch.resolve("sampling")`): `reference.py` (torch: the
fp32 log-softmax, then a two-level fp64 inverse CDF), the default everywhere, or `kernel.py` (one Triton
program per row reading the logits twice, no [N, VOCAB] temporaries; `VERL_MOE_OPS=sampling=triton`).
"""

from __future__ import annotations

import torch

from ..dispatch import resolve
from .reference import check_sampling_inputs, inverse_cdf, sample_tokens_ref

IMPLS = {
    "torch": "verl_moe.ops.sampling.reference:sample_tokens_ref",
    "triton": "verl_moe.ops.sampling.kernel:sample_tokens_triton",
}
# The kernel has run under the Triton interpreter only; the rollout's measured numbers are the torch path's.
ACCELERATOR_DEFAULT = "torch"


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    uniform: torch.Tensor,
    impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_tokens_ref`'s contract through the implementation `resolve("sampling", impl)` picks."""
    return resolve("sampling", impl)(logits, temperature, greedy, uniform)


__all__ = ["ACCELERATOR_DEFAULT", "IMPLS", "check_sampling_inputs", "inverse_cdf", "sample_tokens", "sample_tokens_ref"]
