"""Exact mode's draw: the log-prob returned is the trainer's log-prob head's own computation for the token
(`ops.logprob.exact.scaled_log_softmax`: the fp32 logits times 1 / temperature, the temperature inverted in
fp32 as the engines' packing inverts it, minus the row's normaliser), and the token is drawn from that
distribution: x = logits * (1 / T) in fp32, weights exp(x - c) for a per-row constant c.

On cpu the draw is the reference's inverse CDF over exp of those log-probs. On devices it is the sampling
kernel's (`kernel.py`, the fast path's draw), which computes the same x (fp32 1 / T, one product per logit)
and draws by inverse CDF over exp(x - its chunk's max): the same distribution, rounded by exp as the cpu
form's is; the log-prob is then `logit * (1 / T) - lse` of the drawn token, with the head's normaliser kernel,
instead of the kernel's own (one pass over the logits instead of about ten [rows, vocabulary] passes).
"""

from __future__ import annotations

import torch

from ..exact import by_device
from ..logprob.exact import scaled_log_softmax
from ..logprob.exact_kernel import scaled_logsumexp_triton
from .kernel import sample_tokens_triton
from .reference import check_sampling_inputs, inverse_cdf


def _sample_by_log_softmax(
    logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, uniform: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    check_sampling_inputs(logits, temperature, greedy, uniform)
    logprobs = scaled_log_softmax(logits.float(), 1.0 / temperature.float())
    tokens = torch.where(greedy, logprobs.argmax(-1), inverse_cdf(logprobs.exp(), uniform))
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


def _sample_by_kernel(
    logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, uniform: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    tokens, _ = sample_tokens_triton(logits, temperature, greedy, uniform)
    inv_t = 1.0 / temperature.float()
    lse = scaled_logsumexp_triton(logits, inv_t)
    return tokens, logits.gather(-1, tokens[:, None])[:, 0] * inv_t - lse


# the dispatched "exact" sampling op: `sample_tokens_ref`'s contract
sample_tokens_exact = by_device(_sample_by_log_softmax, _sample_by_kernel)

__all__ = ["sample_tokens_exact"]
