"""Exact mode's log-prob head, in PyTorch (the CPU form), and the one log-softmax it shares with the
rollout's sampler (`ops.sampling.reference.sample_tokens_exact`).

The logits come from the batch-invariant projection in fp32 (`exact_logits`, also the decoder's logits
in exact mode), are scaled by 1/T and go through one `scaled_log_softmax`: the head's log-prob of a
token and the sampler's log-prob of the token it drew are the same computation on the same numbers. The
head builds the [N, VOCAB] fp32 logits (the chunked heads exist to avoid that at scale); its gradient is
the chunked head's (`chunked.logprobs_and_entropy_chunked`), recomputed in backward.
"""

from __future__ import annotations

import torch

from ..exact import exact_forward
from ..linear.exact import linear_rows
from .chunked import LogprobCall, compute_dtype, logprobs_and_entropy_chunked


def exact_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [..., D] @ weight [VOCAB, D].T -> [..., VOCAB] logits in fp32 (fp64 for fp64), each row by
    itself (`linear_rows`)."""
    return linear_rows(hidden, weight, out_dtype=compute_dtype(hidden.dtype))


def scaled_log_softmax(logits: torch.Tensor, inv_temperature: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits [N, VOCAB] * inv_temperature [N]) over the vocabulary, in the logits' dtype."""
    return torch.log_softmax(logits * inv_temperature.to(logits.dtype)[:, None], dim=-1)


def _logprobs_by_rows(hidden, weight, labels, inv_t, call: LogprobCall):
    """`logprobs_and_entropy_chunked`'s contract by `exact_logits` and `scaled_log_softmax`."""
    log_probs = scaled_log_softmax(exact_logits(hidden, weight), inv_t)
    log_prob = log_probs.gather(-1, labels[:, None])[:, 0]
    entropy = -(log_probs.exp() * log_probs).sum(-1) if call.calculate_entropy else None
    return log_prob.float(), None if entropy is None else entropy.float()


# the dispatched "exact" head: per-row logits and one log-softmax forward, the chunked head's gradient
logprobs_and_entropy_exact = exact_forward(_logprobs_by_rows, logprobs_and_entropy_chunked)

__all__ = ["exact_logits", "logprobs_and_entropy_exact", "scaled_log_softmax"]
