"""Sampling one token per row from logits at a temperature, with the processed log-prob of the token:
the rollout's per-step draw when no row filters its distribution (top-k / top-p / min-p / penalty).

`sample_tokens` resolves the implementation (`dispatch.resolve("sampling")`): `reference.py` (torch: the
fp32 log-softmax, then a two-level fp64 inverse CDF; the CPU default) or `kernel.py` (two Triton kernels:
per-chunk statistics from one read of the logits, then a scan of the one chunk each row's draw falls in;
no [N, VOCAB] temporaries; the cuda/npu default). The two round
differently: where a row's number lands within their rounding of a CDF boundary they draw neighbouring
tokens (both within the fp64 bound the op tests check).
"""

from __future__ import annotations

import torch

from ..dispatch import resolve
from .reference import check_sampling_inputs, inverse_cdf, sample_tokens_ref

# cuda/npu take "triton" (dispatch's default for an op with a kernel): one read of the logits and no
# [N, VOCAB] temporaries, several times faster than the reference (docs/ops.md, the ops table)
IMPLS = {
    "torch": "verl_moe.ops.sampling.reference:sample_tokens_ref",
    "triton": "verl_moe.ops.sampling.kernel:sample_tokens_triton",
    "exact": "verl_moe.ops.sampling.exact:sample_tokens_exact",
}


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    uniform: torch.Tensor,
    impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_tokens_ref`'s contract through the implementation `resolve("sampling", impl)` picks."""
    return resolve("sampling", impl)(logits, temperature, greedy, uniform)


__all__ = ["IMPLS", "check_sampling_inputs", "inverse_cdf", "sample_tokens", "sample_tokens_ref"]
