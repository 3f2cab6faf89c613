"""Benchmark cases and providers for `verl-moe bench norm` (Qwen3.5-35B-A3B norm shapes, bf16).

Cases: the decoder norms over D=2048 (Qwen3.5's (1 + weight) and Qwen3-MoE's plain weight), the
q/k norms over [T, H=16, K=256] rows (contiguous, and the strided q view the attention's q_proj
split gives), GatedDeltaNet's gated norm over [T, HV=32, V=128] rows, and the residual add fused
with the norm over D=2048 (returns norm(x + residual) and x + residual).

Providers: "triton" (ours, `fused.rms_norm`), "liger" (`LigerRMSNormFunction`, offset 1.0 with its
"gemma" casting for (1 + weight), "llama" casting for the plain weight; `LigerFusedAddRMSNormFunction`
for the residual cases; Liger has no gated norm, so its gated row is its RMSNorm followed by torch's
silu(gate) multiply), "fla" (`fla.modules.norm.layernorm.rms_norm`, with prenorm for the residual,
given the weight as 1 + weight in fp32 for the unit-offset cases; `rms_norm_gated` with swish for the
gated case), "torch" (our reference, `rms_norm_ref`, the golden of the check).

Outputs, in order: norm, then h (residual cases); for "fwd_bwd" then the gradients of x, weight,
gate, residual (those the case has) of sum(norm * dy) + sum(h * dh).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from verl_moe.ops.dispatch import unrunnable_reason
from verl_moe.ops.norm.reference import rms_norm_ref

EPS = 1e-6
CASES: list[dict] = [
    *(
        {"id": f"{v}-T{t}-D2048", "shape": (t, 2048), "variant": v}
        for t in (8192, 16384)
        for v in ("unit_offset", "plain")
    ),
    {"id": "qk-T16384-H16-K256", "shape": (16384, 16, 256), "variant": "unit_offset"},
    {"id": "q_strided-T16384-H16-K256", "shape": (16384, 16, 256), "variant": "unit_offset", "strided": True},
    {"id": "gated-T16384-HV32-V128", "shape": (16384, 32, 128), "variant": "gated"},
    *(
        {"id": f"residual-T{t}-D2048", "shape": (t, 2048), "variant": "unit_offset", "residual": True}
        for t in (8192, 16384)
    ),
]
PROVIDERS: tuple[str, ...] = ("triton", "liger", "fla", "torch")
REFERENCE = "torch"
MODES = ("fwd", "fwd_bwd")
# rel-RMS vs the bf16 torch reference: both sides round outputs and gradients to bf16 (~2e-3 each);
# fla's (1 + weight) in fp32 and Liger's gate in torch round at slightly different points.
TOLERANCE = {"triton": 1e-2, "liger": 1e-2, "fla": 1e-2, "torch": 0.0}


def unavailable(provider: str) -> str | None:
    """Why `provider` cannot run in this process, or None."""
    if provider not in PROVIDERS:
        return f"unknown provider {provider!r}"
    return unrunnable_reason(provider, interpreter=False)


def make_inputs(case: dict, device: torch.device) -> dict:
    """Leaf inputs (requires_grad): x [*shape] ~ N(0, 3^2) (a strided view of a [..., 2 K] projection for
    "strided"), weight [D] (0.1 * N(0, 1), + 1 for the plain weight), gate and residual [*shape]; fixed
    cotangents dy, dh."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    shape, D = case["shape"], case["shape"][-1]

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=gen) * scale).to(device, torch.bfloat16)

    if case.get("strided"):
        x = rnd(*shape[:-1], 2 * D, scale=3.0)[..., :D]  # q of the q_proj output (q, gate) per head
    else:
        x = rnd(*shape, scale=3.0)
    weight = rnd(D, scale=0.1) + (0.0 if case["variant"] == "unit_offset" else 1.0)
    inputs = {
        "x": x,
        "weight": weight,
        "gate": rnd(*shape) if case["variant"] == "gated" else None,
        "residual": rnd(*shape) if case.get("residual") else None,
    }
    for t in inputs.values():
        if t is not None:
            t.requires_grad_()
    inputs["cot"] = [rnd(*shape) for _ in range(2 if case.get("residual") else 1)]
    inputs["unit_offset"] = case["variant"] == "unit_offset"
    return inputs


def _triton(x, weight, gate, residual, unit_offset):
    from verl_moe.ops.norm.fused import rms_norm

    return rms_norm(x, weight, EPS, unit_offset, gate=gate, residual=residual)


def _torch(x, weight, gate, residual, unit_offset):
    return rms_norm_ref(x, weight, EPS, unit_offset, gate=gate, residual=residual)


def _liger(x, weight, gate, residual, unit_offset):
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    offset, casting = (1.0, "gemma") if unit_offset else (0.0, "llama")
    if residual is not None:
        # positional: X, R, W, eps, offset, casting_mode, in_place
        return LigerFusedAddRMSNormFunction.apply(x, residual, weight, EPS, offset, casting, False)
    # in_place=False: its default writes dx into dy, which every timed call reuses (the cost: a zero
    # fill of dx in its backward)
    y = LigerRMSNormFunction.apply(x, weight, EPS, offset, casting, False)
    if gate is not None:
        y = (y.float() * F.silu(gate.float())).to(x.dtype)
    return y


def _fla(x, weight, gate, residual, unit_offset):
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.modules.norm.layernorm import rms_norm

    if gate is not None:
        return rms_norm_gated(x, gate, weight, None, activation="swish", eps=EPS)
    w = 1.0 + weight.float() if unit_offset else weight
    return rms_norm(x, w, None, residual=residual, eps=EPS, prenorm=residual is not None)


_FNS = {"triton": _triton, "torch": _torch, "liger": _liger, "fla": _fla}


def run(provider: str, inputs: dict, mode: str) -> list[torch.Tensor]:
    """One call of `provider` in `mode`: [norm, (h)] and for "fwd_bwd" the leaves' gradients."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    names = [n for n in ("x", "weight", "gate", "residual") if inputs[n] is not None]
    args = [inputs[n] for n in ("x", "weight", "gate", "residual")] + [inputs["unit_offset"]]
    fn = _FNS[provider]
    if mode == "fwd":
        with torch.no_grad():
            out = fn(*args)
        return list(out) if isinstance(out, tuple) else [out]
    out = fn(*args)
    outs = list(out) if isinstance(out, tuple) else [out]
    grads = torch.autograd.grad(outs, [inputs[n] for n in names], inputs["cot"][: len(outs)])
    return [o.detach() for o in outs] + list(grads)
