"""Full-logits reference for the log-prob + entropy head: the golden the tests run in fp64.

It materialises [N, VOCAB] logits on purpose (readable, dtype-generic); never use it for training.
"""

from __future__ import annotations

import torch


def logprobs_and_entropy_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    calculate_entropy: bool = True,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(label) and entropy of softmax(hidden @ weight.T / T), through plain autograd.

    Args:
        hidden: [N, D] float.
        weight: [VOCAB, D] float, same dtype as hidden.
        labels: [N] int64 in [0, VOCAB).
        temperature: python scalar or [N] tensor, > 0 (not checked here).
        calculate_entropy: also return the entropy.
        dtype: compute dtype (default: the promotion of hidden.dtype and fp32), e.g. torch.float64
            for the golden; inputs are cast, never modified.

    Returns:
        log_prob: [N] in `dtype`.
        entropy: [N] in `dtype`, or None.
    """
    dtype = dtype or torch.promote_types(hidden.dtype, torch.float32)
    logits = hidden.to(dtype) @ weight.to(dtype).t()
    return logprobs_from_logits_ref(logits, labels, temperature, calculate_entropy)


def logprobs_from_logits_ref(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    calculate_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(label) and entropy of softmax(logits / T), in the logits' dtype (for a model that
    returns logits, e.g. megatron's GPTModel).

    Args:
        logits: [N, VOCAB] float.
        labels: [N] int64 in [0, VOCAB).
        temperature: python scalar or [N] tensor, > 0 (not checked here).
        calculate_entropy: also return the entropy.

    Returns:
        log_prob: [N] in logits.dtype.
        entropy: [N] in logits.dtype, or None.
    """
    if isinstance(temperature, torch.Tensor):
        logits = logits / temperature.to(logits.dtype).reshape(-1, 1)
    else:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    log_prob = logp.gather(1, labels.reshape(-1, 1)).squeeze(1)
    entropy = -(logp.exp() * logp).sum(-1) if calculate_entropy else None
    return log_prob, entropy
