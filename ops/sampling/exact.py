"""Exact mode's draw: the log-probs are the trainer's log-prob head's own computation
(`ops.logprob.exact.scaled_log_softmax` of the fp32 logits at 1 / temperature, the temperature inverted
in fp32 as the engines' packing inverts it), and the token is drawn from them, so the log-prob the
rollout returns is the trainer's for that token and that of the distribution the token came from."""

from __future__ import annotations

import torch

from ..logprob.exact import scaled_log_softmax
from .reference import check_sampling_inputs, inverse_cdf


def sample_tokens_exact(
    logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, uniform: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_tokens_ref`'s contract."""
    check_sampling_inputs(logits, temperature, greedy, uniform)
    logprobs = scaled_log_softmax(logits.float(), 1.0 / temperature.float())
    tokens = torch.where(greedy, logprobs.argmax(-1), inverse_cdf(logprobs.exp(), uniform))
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


__all__ = ["sample_tokens_exact"]
