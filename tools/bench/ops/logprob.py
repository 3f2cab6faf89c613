"""Benchmark cases and providers for `verl-moe bench logprob` (Qwen3.5-35B LM head shapes).

Every provider gets the same bf16 inputs and temperature 1.0 (Liger's fused linear CE has no
temperature and verl's FusedLinearForPPO takes a python scalar only). "fwd" runs under no_grad
(the infer_batch path); "fwd_bwd" takes d/d(hidden, weight) of
loss = -mean(log_prob) - 0.01 * mean(entropy) through torch.autograd.grad.

Outputs, in order: log_prob, entropy, d_hidden, d_weight (what a provider has of them).
The check compares them with REFERENCE's ("naive") position by position:
- "liger" returns log_prob only (no entropy; its gradients belong to -mean(log_prob), a different loss),
  so it is checked on log_prob alone;
- "liger_mean" is Liger's reduction="mean" path, which computes the gradients during the forward;
  it has no per-token output and is timed only (returns nothing to check).
The fp64 golden lives in tests/ops/test_logprob.py; "naive" is verl's own math on full logits.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch
from verl_moe.ops.dispatch import unrunnable_reason
from verl_moe.ops.logprob import logprobs_and_entropy

CASES: list[dict] = [
    {"id": f"N{n}-D2048-V248320", "n": n, "d": 2048, "vocab": 248320, "dtype": "bfloat16"} for n in (4096, 16384)
]
PROVIDERS: tuple[str, ...] = ("ours-triton", "ours-torch-chunked", "naive", "verl_chunked", "liger", "liger_mean")
REFERENCE = "naive"
MODES = ("fwd", "fwd_bwd")
# rel-RMS vs naive, whose logits are rounded to bf16 before the fp32 softmax, and all gradients are
# bf16: 1e-2 leaves room for both sides' bf16 rounding (~4e-3 each at most on the gradients)
TOLERANCE: dict[str, float] = {
    "ours-triton": 1e-2,
    "ours-torch-chunked": 1e-2,
    "naive": 0.0,
    "verl_chunked": 1e-2,
    "liger": 1e-2,
    "liger_mean": 0.0,
}
ENTROPY_WEIGHT = 0.01


def unavailable(provider: str) -> str | None:
    """Why `provider` cannot run in this process, or None."""
    if provider not in PROVIDERS:
        return f"unknown provider {provider!r}"
    if provider == "ours-triton":
        return unrunnable_reason("triton", interpreter=False)
    if provider.startswith("liger"):
        if reason := unrunnable_reason("liger"):
            return reason
        try:
            importlib.import_module("liger_kernel.ops.fused_linear_cross_entropy")
        except Exception as exc:  # report why instead of failing the whole run
            return f"liger_kernel does not import: {exc!r}"
    if provider == "verl_chunked":
        if importlib.util.find_spec("verl") is None:
            return "verl is not installed"
        try:
            _verl_module()
        except Exception as exc:
            return f"verl's FusedLinearForPPO does not load: {exc!r}"
    return None


def make_inputs(case: dict, device: torch.device) -> dict:
    """Fresh leaf inputs: hidden [N, D] ~ N(0, 1), weight [VOCAB, D] ~ N(0, 0.02^2), labels [N]."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    dtype = getattr(torch, case["dtype"])
    n, d, vocab = case["n"], case["d"], case["vocab"]
    hidden = torch.randn(n, d, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(vocab, d, generator=gen) * 0.02).to(device, dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=gen).to(device)
    return {"hidden": hidden, "weight": weight, "labels": labels, "temperature": 1.0}


def _naive(hidden, weight, labels, temperature):
    # what verl does without fused kernels: the model's bf16 logits, upcast, log_softmax + gather
    # (verl_F.logprobs_from_logits_naive) and logsumexp - sum(softmax * logits) (entropy_from_logits)
    logits = (hidden @ weight.t()).float() / temperature
    log_prob = torch.log_softmax(logits, -1).gather(1, labels[:, None]).squeeze(1)
    entropy = torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)
    return log_prob, entropy


@functools.cache
def _verl_module():
    # verl/utils/experimental/torch_functional.py loaded as a single file, so verl's package
    # __init__ (ray, tensordict, ...) is not needed where only torch is installed
    spec = importlib.util.find_spec("verl")
    path = f"{spec.submodule_search_locations[0]}/utils/experimental/torch_functional.py"
    mod_spec = importlib.util.spec_from_file_location("_verl_experimental_torch_functional", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


def _verl_chunked(hidden, weight, labels, temperature):
    # verl's FusedLinearForPPO, torch backend: chunked (512 tokens) lm_head + log-prob + entropy
    # with recompute in backward (what verl's fused-kernel path runs without Liger)
    log_prob, entropy = _verl_module().FusedLinearForPPO(impl_backend="torch")(hidden, weight, labels, temperature)
    return log_prob, entropy.float()


def _liger(hidden, weight, labels, reduction):
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    # positional: bias, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction
    return LigerFusedLinearCrossEntropyFunction.apply(hidden, weight, labels, None, None, -100, 0.0, 0.0, reduction)[0]


def _forward(provider, hidden, weight, labels, temperature):
    if provider in ("ours-triton", "ours-torch-chunked"):
        impl = "triton" if provider == "ours-triton" else "torch"
        return logprobs_and_entropy(hidden, weight, labels, temperature, impl=impl)
    if provider == "naive":
        return _naive(hidden, weight, labels, temperature)
    if provider == "verl_chunked":
        return _verl_chunked(hidden, weight, labels, temperature)
    if provider == "liger":
        return -_liger(hidden, weight, labels, "none"), None
    raise ValueError(f"unknown provider {provider!r}")


def run(provider: str, inputs: dict, mode: str) -> list[torch.Tensor]:
    """One call of `provider` in `mode`; returns [log_prob, entropy, d_hidden, d_weight] (what it has)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    hidden, weight, labels, temperature = (inputs[k] for k in ("hidden", "weight", "labels", "temperature"))
    if provider == "liger_mean":
        if mode == "fwd":
            with torch.no_grad():
                _liger(hidden.detach(), weight.detach(), labels, "mean")
        else:
            torch.autograd.grad(_liger(hidden, weight, labels, "mean"), [hidden, weight])
        return []
    if mode == "fwd":
        with torch.no_grad():
            log_prob, entropy = _forward(provider, hidden.detach(), weight.detach(), labels, temperature)
        return [t for t in (log_prob, entropy) if t is not None]
    log_prob, entropy = _forward(provider, hidden, weight, labels, temperature)
    loss = -log_prob.mean()
    if entropy is not None:
        loss = loss - ENTROPY_WEIGHT * entropy.mean()
    d_hidden, d_weight = torch.autograd.grad(loss, [hidden, weight])
    if entropy is None:
        return [log_prob.detach()]
    return [log_prob.detach(), entropy.detach(), d_hidden, d_weight]
