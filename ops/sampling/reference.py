"""The reference of the sampling op: one token per row by inverse-CDF sampling at a temperature.

Row n: x = logits[n] / temperature[n] (fp32); log-probs = log_softmax(x); a greedy row takes the first
argmax of x, any other row the first token whose CDF exceeds uniform[n] x the total (as torch.multinomial
draws, with the row's own number). The token's log-prob under that distribution comes back with it
(vLLM's processed log-probs). The CDF is summed in fp64 in two levels (`inverse_cdf`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CDF_BLOCK = 1024


def check_sampling_inputs(logits, temperature, greedy, uniform) -> None:
    """Raise ValueError for shapes or dtypes the op cannot take (no value is read)."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating [N, VOCAB] tensor, got {tuple(logits.shape)} {logits.dtype}")
    N = logits.shape[0]
    for name, t, kind in (
        ("temperature", temperature, "floating"),
        ("greedy", greedy, "bool"),
        ("uniform", uniform, "fp64"),
    ):
        ok = {"floating": t.is_floating_point(), "bool": t.dtype == torch.bool, "fp64": t.dtype == torch.float64}[kind]
        if tuple(t.shape) != (N,) or not ok:
            raise ValueError(f"{name} must be a [{N}] {kind} tensor, got {tuple(t.shape)} {t.dtype}")


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row of probs [N, V] (any non-negative weights), the first token whose CDF exceeds uniform x
    the row's total, the CDF summed in fp64 in two levels (block totals, then the prefix of the one block
    the target falls in) instead of one fp64 scan of the whole row, which moves ~12x the bytes. fp64: a
    scan may round a masked (zero-weight) token's CDF one ulp above its neighbour's, leaving it a ~1e-16
    chance in fp64 (~1e-7 in fp32, times the masked tokens)."""
    N, V = probs.shape
    blocks = F.pad(probs, (0, -V % CDF_BLOCK)).view(N, -1, CDF_BLOCK)
    ends = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [N, V / BLOCK] CDF at each block's end
    total = ends[:, -1:]
    target = torch.minimum(uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(ends, target, right=True).clamp(max=ends.shape[1] - 1)  # [N, 1]
    start = torch.where(block > 0, ends.gather(1, (block - 1).clamp(min=0)), 0.0)
    inner = blocks.gather(1, block[:, :, None].expand(N, 1, CDF_BLOCK))[:, 0].double().cumsum(-1) + start
    within = torch.searchsorted(inner, target, right=True).clamp(max=CDF_BLOCK - 1)
    return (block * CDF_BLOCK + within)[:, 0].clamp(max=V - 1)


def sample_tokens_ref(
    logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, uniform: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row.

    Args:
        logits: [N, VOCAB] any float dtype. temperature: [N] > 0 (a greedy row's is used for its
            log-prob: vLLM gives greedy rows the log-probs of temperature 1). greedy: [N] bool.
        uniform: [N] fp64 in [0, 1), each row's number (ignored for greedy rows).
    Returns:
        tokens [N] int64, their log-probs [N] fp32.
    Raises:
        ValueError: bad shapes or dtypes.
    """
    check_sampling_inputs(logits, temperature, greedy, uniform)
    x = logits.float() / temperature.float()[:, None]
    logprobs = torch.log_softmax(x, dim=-1)
    tokens = torch.where(greedy, x.argmax(-1), inverse_cdf(logprobs.exp(), uniform))
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


__all__ = ["CDF_BLOCK", "check_sampling_inputs", "inverse_cdf", "sample_tokens_ref"]
