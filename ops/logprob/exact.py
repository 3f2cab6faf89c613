"""Exact mode's log-prob head, and the one log-softmax it shares with the rollout's sampler
(`ops.sampling.exact.sample_tokens_exact`).

The logits come from the batch-invariant projection in fp32 (`exact_logits`, also the decoder's logits
in exact mode), are scaled by 1/T and go through one `scaled_log_softmax`: the head's log-prob of a
token and the sampler's log-prob of the token it drew are the same computation on the same numbers.
On cpu that is torch's log_softmax; on devices the normaliser comes from one Triton program per row
(`exact_kernel.py`) and the log-probs are `logits * (1/T) - lse`, elementwise (the head computes it for
the label's logit only). The head builds the fp32 logits of ROWS_PER_PASS rows at a time; its gradient
is the fast head's (the chunked one on cpu, the fused kernels on devices), taken from this forward's
normaliser without running the fast forward again.
"""

from __future__ import annotations

import torch

from ..linear.exact import linear_rows
from ..linear.exact_kernel import linear_rows_triton
from .chunked import LogprobCall, chunked_backward, compute_dtype
from .exact_kernel import scaled_logsumexp_triton
from .fused import fused_backward

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


def _forward_by_rows(hidden, weight, labels, inv_t, entropy: bool):
    """(log_prob [N], entropy [N] | None, lse [N]) by `exact_logits` and the normaliser of
    `scaled_log_softmax`, ROWS_PER_PASS rows at a time (each row's numbers are its own, so the split
    changes nothing). A label's log-prob is `logit * (1/T) - lse` of that one logit: the same two roundings
    as `scaled_log_softmax` gives it in the sampler's full row."""
    log_prob, ent, lse = [], [], []
    for a in range(0, max(hidden.shape[0], 1), ROWS_PER_PASS):
        rows = slice(a, a + ROWS_PER_PASS)
        logits, inv = exact_logits(hidden[rows], weight), inv_t[rows]
        if logits.device.type == "cpu":
            log_probs = scaled_log_softmax(logits, inv)
            log_prob.append(log_probs.gather(-1, labels[rows, None])[:, 0])
            lse.append(torch.logsumexp(logits * inv.to(logits.dtype)[:, None], -1))  # for the gradient only
        else:
            lse.append(scaled_logsumexp_triton(logits, inv))
            label_logit = logits.gather(-1, labels[rows, None])[:, 0]
            log_prob.append(label_logit * inv.to(logits.dtype) - lse[-1])
            log_probs = scaled_log_softmax(logits, inv) if entropy else None
        if entropy:
            ent.append(-(log_probs.exp() * log_probs).sum(-1))
        del logits, log_probs
    return torch.cat(log_prob), torch.cat(ent) if entropy else None, torch.cat(lse)


class LogprobExactFunction(torch.autograd.Function):
    """forward: per-row logits and one log-softmax (`_forward_by_rows`); backward: the fast head's gradient
    (`chunked_backward` on cpu, the fused kernels' on devices) from this forward's lse and entropy, with no
    second forward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, inv_t, call: LogprobCall):
        ctx.set_materialize_grads(False)
        log_prob, entropy, lse = _forward_by_rows(hidden, weight, labels, inv_t, call.calculate_entropy)
        ctx.save_for_backward(hidden, weight, labels, inv_t, lse, entropy)
        ctx.call = call
        if entropy is not None and not call.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return log_prob.float(), None if entropy is None else entropy.float()

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        backward = chunked_backward if ctx.saved_tensors[0].device.type == "cpu" else fused_backward
        dh, dw = backward(*ctx.saved_tensors, g_lp, g_ent, ctx.call, *ctx.needs_input_grad[:2])
        return dh, dw, None, None, None


def logprobs_and_entropy_exact(hidden, weight, labels, inv_t, call: LogprobCall):
    """The dispatched "exact" head: `logprobs_and_entropy_chunked`'s contract, computed per row."""
    return LogprobExactFunction.apply(hidden, weight, labels, inv_t, call)


__all__ = ["LogprobExactFunction", "exact_logits", "logprobs_and_entropy_exact", "scaled_log_softmax"]
