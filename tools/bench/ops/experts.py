"""Benchmark cases and providers for `verl-moe bench experts` (Qwen3.5-35B-A3B routed experts: 256
experts top-8, D=2048, I=512, bf16 weights and activations, fp32 router weights).

Providers, all on the same inputs (transformers' fused [E, 2I, D] / [E, D, I] layout):
- "triton": ours, grouped GEMMs with the Triton token moves (the default on cuda/npu);
- "grouped": ours, the same GEMMs with torch token moves (argsort and indexing);
- "liger": Liger's fused MoE (`LigerFusedMoEFunction`, its Triton grouped GEMM), when installed;
- "transformers": transformers' `Qwen3_5MoeExperts` with `_experts_implementation="grouped_mm"`;
- "torch": our loop over experts (`moe_experts_ref`), the reference of the check.
"fwd" runs under no_grad; "fwd_bwd" takes d/d(hidden, gate_up_proj, down_proj, topk_weight) of
sum(out * dy) through torch.autograd.grad. Outputs, in order: out, d_hidden, d_gate_up, d_down,
d_weight. The fp64 golden lives in tests/ops/test_experts.py.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch
from verl_moe.ops.dispatch import resolve, unrunnable_reason
from verl_moe.ops.experts.reference import moe_experts_ref

_QWEN = {"E": 256, "topk": 8, "D": 2048, "I": 512, "dtype": "bfloat16"}
CASES: list[dict] = [{"id": f"T{t}-E256-top8-D2048-I512", "T": t, **_QWEN} for t in (8192, 16384)]
# A small case that runs on CPU (the torch providers; "triton" under TRITON_INTERPRET=1).
CASES.append({"id": "tiny-T64-E8-top2-D64-I32", "T": 64, "E": 8, "topk": 2, "D": 64, "I": 32, "dtype": "float32"})
PROVIDERS: tuple[str, ...] = ("triton", "grouped", "liger", "transformers", "torch")
REFERENCE = "torch"
MODES = ("fwd", "fwd_bwd")
# rel-RMS vs the bf16 loop reference: both sides round the GEMM outputs to bf16 (~4e-3 each at most)
TOLERANCE: dict[str, float] = {"triton": 1e-2, "grouped": 1e-2, "liger": 1e-2, "transformers": 1e-2, "torch": 0.0}


def unavailable(provider: str) -> str | None:
    """Why `provider` cannot run in this process, or None."""
    if provider not in PROVIDERS:
        return f"unknown provider {provider!r}"
    if provider == "triton":
        return unrunnable_reason("triton")  # the tiny case runs under TRITON_INTERPRET=1
    if provider == "liger":
        if reason := unrunnable_reason("liger"):
            return reason
        try:
            module = importlib.import_module("liger_kernel.ops.fused_moe")
        except Exception as exc:  # report why instead of failing the whole run
            return f"liger_kernel has no fused MoE here: {exc!r}"
        if not hasattr(module, "LigerFusedMoEFunction"):
            return "liger_kernel.ops.fused_moe has no LigerFusedMoEFunction in this version"
    if provider == "transformers":
        try:
            _hf_experts_class()
        except Exception as exc:
            return f"transformers' Qwen3_5MoeExperts does not load: {exc!r}"
    return None


def make_inputs(case: dict, device: torch.device) -> dict:
    """Fresh leaf inputs: hidden [T, D] ~ N(0, 1), weights ~ N(0, 0.02^2), topk_idx / topk_weight the
    softmax top-k of random logits (fp32 weights, renormalised), dy [T, D]."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    dtype = getattr(torch, case["dtype"])
    T, E, K, D, I = (case[k] for k in ("T", "E", "topk", "D", "I"))

    def leaf(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dt).requires_grad_()

    probs = torch.softmax(torch.randn(T, E, generator=gen), -1)
    weight, idx = probs.topk(K, -1)
    return {
        "hidden": leaf(T, D),
        "gate_up_proj": leaf(E, 2 * I, D, scale=0.02),
        "down_proj": leaf(E, D, I, scale=0.02),
        "topk_idx": idx.to(device),
        "topk_weight": (weight / weight.sum(-1, keepdim=True)).to(device).requires_grad_(),
        "dy": torch.randn(T, D, generator=gen).to(device, dtype),
    }


def _hf_experts_class():
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts

    return Qwen3_5MoeExperts


def _hf_module(gate_up, down):
    """transformers' experts module (grouped_mm path) whose weights are the given leaves (built on the
    meta device: no weight copy)."""
    from transformers import Qwen3_5MoeTextConfig

    E, two_i, D = gate_up.shape
    config = Qwen3_5MoeTextConfig(hidden_size=D, moe_intermediate_size=two_i // 2, num_experts=E)
    config._experts_implementation = "grouped_mm"
    with torch.device("meta"):
        module = _hf_experts_class()(config)
    del module.gate_up_proj, module.down_proj
    module.gate_up_proj, module.down_proj = gate_up, down
    return module


def _liger_forward(hidden, gate_up, down, idx, weight):
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    return LigerFusedMoEFunction.apply(hidden, gate_up, down, idx.to(torch.int32), weight)


def _forward(provider, hidden, gate_up, down, idx, weight, inputs):
    if provider in ("triton", "grouped"):
        return resolve("experts", provider)(hidden, gate_up, down, idx, weight)
    if provider == "torch":
        return moe_experts_ref(hidden, gate_up, down, idx, weight)
    if provider == "transformers":
        module = inputs.setdefault("_hf_module", _hf_module(inputs["gate_up_proj"], inputs["down_proj"]))
        module.gate_up_proj, module.down_proj = gate_up, down  # the leaves, or their detached views
        return module(hidden, idx, weight)
    if provider == "liger":
        return _liger_forward(hidden, gate_up, down, idx, weight)
    raise ValueError(f"unknown provider {provider!r}")


def run(provider: str, inputs: dict, mode: str) -> list[torch.Tensor]:
    """One call of `provider` in `mode`; returns [out] (fwd) or [out, d_hidden, d_gate_up, d_down, d_weight]."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    names = ("hidden", "gate_up_proj", "down_proj", "topk_weight")
    leaves = [inputs[k] for k in names]
    if mode == "fwd":
        with torch.no_grad():
            out = _forward(provider, *(t.detach() for t in leaves[:3]), inputs["topk_idx"], leaves[3].detach(), inputs)
        return [out]
    out = _forward(provider, *leaves[:3], inputs["topk_idx"], leaves[3], inputs)
    grads = torch.autograd.grad((out * inputs["dy"]).sum(), leaves)
    return [out.detach(), *grads]
