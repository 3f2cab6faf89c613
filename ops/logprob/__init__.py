"""Memory-efficient LM head: per-token log p(label) and entropy without [N, VOCAB] fp32 logits.

`logprobs_and_entropy` validates, normalises the temperature and dispatches (`ops.dispatch`) to
the Triton path (`fused.py`) or the chunked torch path (`chunked.py`); `logprob_head` resolves the
implementation once and takes the inverse temperature per token as given (the engines' head);
`reference.py` holds the full-logits golden.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..dispatch import resolve
from .chunked import LogprobCall, LogprobOptions, compute_dtype
from .reference import logprobs_and_entropy_ref

IMPLS = {
    "torch": "verl_moe.ops.logprob.chunked:logprobs_and_entropy_chunked",
    "triton": "verl_moe.ops.logprob.fused:logprobs_and_entropy_fused",
    "exact": "verl_moe.ops.logprob.exact:logprobs_and_entropy_exact",
}

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_tensors(hidden, weight, labels) -> None:
    """Raise ValueError on shapes, dtypes or devices the head cannot take (no device read)."""
    if hidden.ndim != 2 or weight.ndim != 2 or labels.ndim != 1:
        raise ValueError(
            f"expected hidden [N, D], weight [VOCAB, D], labels [N]; got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(labels.shape)}"
        )
    n, d = hidden.shape
    if weight.shape[1] != d or labels.shape[0] != n:
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, labels {tuple(labels.shape)}"
        )
    if weight.shape[0] == 0 or d == 0:
        raise ValueError(f"VOCAB and D must be positive, got weight {tuple(weight.shape)}")
    if hidden.dtype not in _FLOATS or weight.dtype != hidden.dtype:
        raise ValueError(f"hidden and weight need one float dtype, got {hidden.dtype} and {weight.dtype}")
    if labels.dtype != torch.int64:
        raise ValueError(f"labels must be int64, got {labels.dtype}")
    if not (hidden.device == weight.device == labels.device):
        raise ValueError(f"devices differ: {hidden.device}, {weight.device}, {labels.device}")


def _check_values(bad_temperature: torch.Tensor, labels: torch.Tensor, vocab: int) -> None:
    """Raise ValueError on a bad temperature flag or a label outside [0, VOCAB): one device read for both;
    on cuda checked by the device without waiting for it (a device-side assert with the message): a host read
    here would hold the step's launches until the forward before it had run."""
    bad_label = ((labels < 0) | (labels >= vocab)).any() if labels.numel() else torch.zeros_like(bad_temperature)
    if labels.device.type == "cuda":
        torch._assert_async(~bad_temperature, "temperature must be finite and > 0 for every token")
        torch._assert_async(~bad_label, f"labels must lie in [0, VOCAB={vocab})")
        return
    flags = torch.stack([bad_temperature, bad_label]).tolist()
    if flags[0]:
        raise ValueError("temperature must be finite and > 0 for every token")
    if flags[1]:
        raise ValueError(f"labels must lie in [0, VOCAB={vocab})")


def _inverse_temperature(temperature, n: int, acc: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(1/T as an [N] tensor in the compute dtype, a 0-dim flag of a non-finite or non-positive T on the
    device); a bad python scalar raises ValueError at once."""
    if isinstance(temperature, torch.Tensor):
        if temperature.ndim > 1 or (temperature.ndim == 1 and temperature.shape[0] != n):
            raise ValueError(f"temperature must be a scalar or [N={n}], got {tuple(temperature.shape)}")
        if not temperature.is_floating_point() or temperature.device != device:
            raise ValueError(f"temperature must be a float tensor on {device}")
        inv_t = (1.0 / temperature.to(acc)).expand(n).contiguous()
        return inv_t, ~((temperature > 0) & torch.isfinite(temperature)).all()
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    inv_t = torch.full((n,), 1.0 / temperature, dtype=acc, device=device)
    return inv_t, torch.zeros((), dtype=torch.bool, device=device)


def _run(fn: Callable, hidden, weight, labels, inv_t, calculate_entropy: bool, entropy_grad: bool, options):
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    call = LogprobCall(calculate_entropy, entropy_grad, options or LogprobOptions())
    return fn(hidden, weight, labels.contiguous(), inv_t, call)


def logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    calculate_entropy: bool = True,
    entropy_grad: bool = True,
    impl: str | None = None,
    options: LogprobOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fused LM head + log-softmax at the labels + entropy, chunked so [N, VOCAB] never exists in fp32.

    z = (hidden @ weight.T) / T (out of place), accumulated in fp32 (fp64 for fp64 inputs).

    Args:
        hidden: [N, D] fp16/bf16/fp32/fp64 final hidden states (packed tokens).
        weight: [VOCAB, D] LM head weight, same dtype and device.
        labels: [N] int64 in [0, VOCAB).
        temperature: python scalar or [N] (or 0-dim) float tensor, finite and > 0.
        calculate_entropy: return the entropy of softmax(z) too.
        entropy_grad: when False the entropy is returned without gradient (log_prob keeps its own).
        impl: "triton" | "torch" | None (ops dispatch: VERL_MOE_OPS, else by device).
        options: working-set knobs (`LogprobOptions`).

    Returns:
        log_prob: [N] fp32 log softmax(z)[label], <= 0.
        entropy: [N] fp32 >= 0, or None when calculate_entropy is False.
        Both differentiable w.r.t. hidden and weight; inputs are never modified.

    Raises:
        ValueError: bad shapes or dtypes, labels out of range, temperature <= 0 (before any launch; on cuda a
            tensor's values are checked by the device, a device-side assert),
            or an impl that cannot run here.
    """
    _check_tensors(hidden, weight, labels)
    inv_t, bad_t = _inverse_temperature(temperature, hidden.shape[0], compute_dtype(hidden.dtype), hidden.device)
    _check_values(bad_t, labels, weight.shape[0])
    return _run(resolve("logprob", impl), hidden, weight, labels, inv_t, calculate_entropy, entropy_grad, options)


@dataclass(frozen=True)
class LogprobHead:
    """`logprobs_and_entropy` with its implementation resolved once (`logprob_head`), as a model's ops
    are at build: what an engine calls per micro-batch. It takes the temperature already inverted
    per token and validated by the caller (the engines' packing does it once per micro-batch).

    __call__(hidden [N, D], weight [VOCAB, D], labels [N] int64, inv_temperature [N] float (1/T,
    finite and > 0: not checked again), calculate_entropy=True, entropy_grad=True) -> (log_prob [N],
    entropy [N] or None), fp32, as `logprobs_and_entropy`. Raises ValueError on bad shapes, dtypes,
    devices or labels.
    """

    fn: Callable
    options: LogprobOptions = field(default_factory=LogprobOptions)

    def __call__(self, hidden, weight, labels, inv_temperature, calculate_entropy=True, entropy_grad=True):
        _check_tensors(hidden, weight, labels)
        n = hidden.shape[0]
        if inv_temperature.shape != (n,) or not inv_temperature.is_floating_point():
            raise ValueError(
                f"inv_temperature must be a float [N={n}], got {inv_temperature.dtype} {tuple(inv_temperature.shape)}"
            )
        if inv_temperature.device != hidden.device:
            raise ValueError(f"inv_temperature must be on {hidden.device}, got {inv_temperature.device}")
        _check_values(torch.zeros((), dtype=torch.bool, device=hidden.device), labels, weight.shape[0])
        inv_t = inv_temperature.to(compute_dtype(hidden.dtype))
        return _run(self.fn, hidden, weight, labels, inv_t, calculate_entropy, entropy_grad, self.options)


def logprob_head(impl: str | None = None, options: LogprobOptions | None = None) -> LogprobHead:
    """The head with `resolve("logprob", impl)` chosen now (see `logprobs_and_entropy` for impl)."""
    return LogprobHead(resolve("logprob", impl), options or LogprobOptions())


__all__ = [
    "IMPLS",
    "LogprobHead",
    "LogprobOptions",
    "logprob_head",
    "logprobs_and_entropy",
    "logprobs_and_entropy_ref",
]
