"""Benchmark cases and providers for `verl-moe bench router` (Qwen3.5-35B-A3B router: D=2048, 256
experts top-8, renormalised; bf16 activations and router weight).

Providers, on the same inputs:
- "triton": ours, the fp32 router as one GEMM plus the softmax/top-k kernel (default on cuda/npu);
- "torch": ours, `route_ref` in fp32 (an fp32 copy of hidden, fp32 GEMM, torch softmax/topk), the
  reference of the check;
- "transformers": transformers' `Qwen3_5MoeTopKRouter` (the GEMM in bf16, the softmax in fp32): an
  anchor with other numerics (its bf16 logits flip near-tied experts: checked loosely, see TOLERANCE).
"fwd" runs under no_grad; "fwd_bwd" takes d/d(hidden, gate_weight) of
sum(topk_weight * dw) + sum(logits * dl) (dl stands for the load-balancing loss's gradient).
Outputs, in order: logits, topk_weight, d_hidden, d_gate_weight.
"""

from __future__ import annotations

import torch
from verl_moe.ops.dispatch import unrunnable_reason
from verl_moe.ops.router.reference import route_ref

CASES: list[dict] = [
    {"id": f"T{t}-D2048-E256-top8", "T": t, "D": 2048, "E": 256, "topk": 8, "dtype": "bfloat16"} for t in (8192, 16384)
]
# A small case that runs on CPU ("triton" under TRITON_INTERPRET=1).
CASES.append({"id": "tiny-T64-D64-E16-top4", "T": 64, "D": 64, "E": 16, "topk": 4, "dtype": "float32"})
PROVIDERS: tuple[str, ...] = ("triton", "torch", "transformers")
REFERENCE = "torch"
MODES = ("fwd", "fwd_bwd")
# triton: the same fp32 math in another summation order (logits 2.1e-6, weights 1.6e-6 on a GPU):
# a near-tied token whose 8th and 9th experts swap sends its gradient to another logit, d_hidden and
# d_gate_weight 1.1e-2 at T=16384 (about one such token: sqrt(2 / 16384)); 0.05 leaves room for a few.
# transformers: bf16 logits (rel RMS 1.7e-3 at T=8192 on CPU) flip many near ties: the weights barely
# move (3.8e-3) but those tokens' gradients land on another expert's logit (0.29): a loose gate.
TOLERANCE: dict[str, float] = {"triton": 5e-2, "torch": 0.0, "transformers": 0.5}


def unavailable(provider: str) -> str | None:
    """Why `provider` cannot run in this process, or None."""
    if provider not in PROVIDERS:
        return f"unknown provider {provider!r}"
    if provider == "triton":
        return unrunnable_reason("triton")  # the tiny case runs under TRITON_INTERPRET=1
    if provider == "transformers":
        try:
            from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter  # noqa: F401
        except Exception as exc:
            return f"transformers' Qwen3_5MoeTopKRouter does not load: {exc!r}"
    return None


def make_inputs(case: dict, device: torch.device) -> dict:
    """Leaf hidden [T, D] ~ N(0, 1) and gate_weight [E, D] ~ N(0, 0.02^2) in the case dtype; fixed
    fp32 cotangents for the weights [T, TOPK] and the logits [T, E]."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    dtype = getattr(torch, case["dtype"])
    T, D, E, K = (case[k] for k in ("T", "D", "E", "topk"))
    return {
        "hidden": torch.randn(T, D, generator=gen).to(device, dtype).requires_grad_(),
        "gate_weight": (torch.randn(E, D, generator=gen) * 0.02).to(device, dtype).requires_grad_(),
        "top_k": K,
        "dw": torch.randn(T, K, generator=gen).to(device),
        "dl": (torch.randn(T, E, generator=gen) * 1e-3).to(device),
    }


def _hf_router(weight, top_k):
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter

    E, D = weight.shape
    config = Qwen3_5MoeTextConfig(hidden_size=D, num_experts=E, num_experts_per_tok=top_k)
    with torch.device("meta"):
        module = Qwen3_5MoeTopKRouter(config)
    del module.weight
    module.weight = weight
    return module


def _forward(provider, hidden, weight, inputs):
    top_k = inputs["top_k"]
    if provider == "triton":
        from verl_moe.ops.router.topk import route_triton

        logits, tw, _ = route_triton(hidden, weight, top_k, True)
    elif provider == "torch":
        logits, tw, _ = route_ref(hidden, weight, top_k, True)
    elif provider == "transformers":
        if "_hf_router" not in inputs:  # built once: a config and a module per call would be timed too
            inputs["_hf_router"] = _hf_router(inputs["gate_weight"], top_k)
        module = inputs["_hf_router"]
        module.weight = weight  # the leaf, or its detached view
        logits, tw, _ = module(hidden)
    else:
        raise ValueError(f"unknown provider {provider!r}")
    return logits.float(), tw.float()


def run(provider: str, inputs: dict, mode: str) -> list[torch.Tensor]:
    """One call of `provider` in `mode`; returns [logits, topk_weight] (fwd) or those and
    [d_hidden, d_gate_weight] (fwd_bwd)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    hidden, weight = inputs["hidden"], inputs["gate_weight"]
    if mode == "fwd":
        with torch.no_grad():
            return list(_forward(provider, hidden.detach(), weight.detach(), inputs))
    logits, tw = _forward(provider, hidden, weight, inputs)
    loss = (tw * inputs["dw"]).sum() + (logits * inputs["dl"]).sum()
    return [logits.detach(), tw.detach(), *torch.autograd.grad(loss, [hidden, weight])]
