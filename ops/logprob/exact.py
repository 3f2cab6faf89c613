"""Exact mode's log-prob head, and the one log-softmax it shares with the rollout's sampler
(`ops.sampling.exact.sample_tokens_exact`).

The logits come from the batch-invariant projection in fp32 (`exact_logits`, also the decoder's logits
in exact mode), are scaled by 1/T and go through one `scaled_log_softmax`: the head's log-prob of a
token and the sampler's log-prob of the token it drew are the same computation on the same numbers.
On cpu that is torch's log_softmax; on devices the normaliser comes from one Triton program per row
(`exact_kernel.py`) and the log-probs are `logits * (1/T) - lse`, elementwise. The head builds the fp32
logits of ROWS_PER_PASS rows at a time; its gradient is the fast head's (the chunked one on cpu, the
fused kernel on devices), recomputed in backward.
"""

from __future__ import annotations

import torch

from ..exact import by_device, device_default, exact_forward
from ..linear.exact import linear_rows
from ..linear.exact_kernel import linear_rows_triton
from .chunked import LogprobCall, compute_dtype, logprobs_and_entropy_chunked
from .exact_kernel import scaled_logsumexp_triton

ROWS_PER_PASS = 1024  # head rows whose [rows, VOCAB] fp32 logits exist at once (1 GiB at VOCAB 248k)


def exact_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [..., D] @ weight [VOCAB, D].T -> [..., VOCAB] logits in fp32 (fp64 for fp64), each row by
    itself (`linear_rows` on cpu, its kernel on devices)."""
    if hidden.device.type == "cpu":
        return linear_rows(hidden, weight, out_dtype=compute_dtype(hidden.dtype))
    return linear_rows_triton(hidden, weight, out_dtype=torch.float32)


def scaled_log_softmax(logits: torch.Tensor, inv_temperature: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits [N, VOCAB] * inv_temperature [N]) over the vocabulary, in the logits' dtype."""
    scaled = logits * inv_temperature.to(logits.dtype)[:, None]
    if logits.device.type == "cpu":
        return torch.log_softmax(scaled, dim=-1)
    return scaled - scaled_logsumexp_triton(logits, inv_temperature)[:, None]


def _logprobs_by_rows(hidden, weight, labels, inv_t, call: LogprobCall):
    """`logprobs_and_entropy_chunked`'s contract by `exact_logits` and `scaled_log_softmax`, ROWS_PER_PASS
    rows at a time (each row's numbers are its own, so the split changes nothing)."""
    log_prob, entropy = [], []
    for a in range(0, max(hidden.shape[0], 1), ROWS_PER_PASS):
        rows = slice(a, a + ROWS_PER_PASS)
        log_probs = scaled_log_softmax(exact_logits(hidden[rows], weight), inv_t[rows])
        log_prob.append(log_probs.gather(-1, labels[rows, None])[:, 0].float())
        if call.calculate_entropy:
            entropy.append(-(log_probs.exp() * log_probs).sum(-1).float())
        del log_probs
    return torch.cat(log_prob), torch.cat(entropy) if call.calculate_entropy else None


# the dispatched "exact" head: per-row logits and one log-softmax forward, the fast head's gradient
logprobs_and_entropy_exact = exact_forward(
    _logprobs_by_rows, by_device(logprobs_and_entropy_chunked, device_default("logprob"))
)

__all__ = ["exact_logits", "logprobs_and_entropy_exact", "scaled_log_softmax"]
