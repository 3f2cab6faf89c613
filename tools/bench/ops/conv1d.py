"""Benchmark cases for `verl-moe bench conv1d`: our Triton kernels against fla and the torch reference.

Qwen3.5-35B-A3B GatedDeltaNet short conv: C = 2 * 16 * 128 + 32 * 128 = 8192 channels (q|k|v), W = 4,
SiLU, no bias, bf16 x and weight, T packed tokens as 1 or 64 sequences (always with cu_seqlens, as
the model passes them). "torch" is `causal_conv1d_ref` (fp32 inside, one F.conv1d per sequence), also
the golden of the correctness check; "fla" is `fla.modules.convolution.causal_conv1d` (Triton backend).
Outputs, in order: y, then for "fwd_bwd" dx, dweight of sum(y * dy).
"""

from __future__ import annotations

import torch
from verl_moe.ops.dispatch import unrunnable_reason

CASES = [{"id": f"T{t}-C8192-W4-N{n}", "T": t, "C": 8192, "W": 4, "N": n} for t in (8192, 16384) for n in (1, 64)]
PROVIDERS = ("triton", "fla", "torch")
REFERENCE = "torch"
MODES = ("fwd", "fwd_bwd")
# Max relative RMS error over y, dx, dweight against the reference: bf16 outputs on both sides
# (tests/ops/test_conv1d.py bounds ours at 1e-2 against fp64).
TOLERANCE = {"triton": 1e-2, "fla": 1e-2, "torch": 0.0}


def unavailable(provider: str) -> str | None:
    """Why `provider` cannot run in this process, or None."""
    if provider not in PROVIDERS:
        return f"unknown provider {provider!r}"
    return unrunnable_reason(provider, interpreter=False)


def make_inputs(case: dict, device: torch.device) -> dict:
    """Leaf x [1, T, C] and weight [C, W] (requires_grad, bf16), a fixed cotangent dy, cu_seqlens [N+1]."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    T, C, W, N = (case[n] for n in ("T", "C", "W", "N"))
    x = torch.randn(1, T, C, generator=gen).to(device).bfloat16().requires_grad_()
    # nn.Conv1d's default init scale (fan_in = W) keeps pre-activations O(1)
    weight = (torch.rand(C, W, generator=gen) * 2 - 1).mul(W**-0.5).to(device).bfloat16().requires_grad_()
    dy = torch.randn(1, T, C, generator=gen).to(device).bfloat16()
    cuts = torch.randperm(T - 1, generator=gen)[: N - 1].add(1).sort().values.tolist()
    cu = torch.tensor([0, *cuts, T], dtype=torch.int32, device=device)
    return {"x": x, "weight": weight, "dy": dy, "cu_seqlens": cu}


def _ours(x):
    from verl_moe.ops.conv1d.conv import causal_conv1d

    return causal_conv1d(x["x"], x["weight"], None, activation="silu", cu_seqlens=x["cu_seqlens"])


def _fla(x):
    from fla.modules.convolution import causal_conv1d

    # fla's signature (0.6): x [B, T, D], weight [D, W], ..., activation, backend, cu_seqlens -> (y, final state)
    return causal_conv1d(
        x=x["x"], weight=x["weight"], bias=None, activation="silu", backend="triton", cu_seqlens=x["cu_seqlens"]
    )[0]


def _torch(x):
    from verl_moe.ops.conv1d.reference import causal_conv1d_ref

    return causal_conv1d_ref(x["x"], x["weight"], None, activation="silu", cu_seqlens=x["cu_seqlens"])


def run(provider: str, inputs: dict, mode: str) -> list[torch.Tensor]:
    """One call; for "fwd_bwd" also the backward of sum(y * dy). Returns [y] (+ dx, dweight)."""
    fn = {"triton": _ours, "fla": _fla, "torch": _torch}[provider]
    leaves = [inputs["x"], inputs["weight"]]
    if mode == "fwd":
        with torch.no_grad():
            return [fn(inputs)]
    for t in leaves:
        t.grad = None
    y = fn(inputs)
    y.backward(inputs["dy"])
    return [y.detach()] + [t.grad for t in leaves]
