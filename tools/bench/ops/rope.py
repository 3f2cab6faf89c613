"""Benchmark cases for `verl-moe bench rope`: our Triton rotation against Liger's and the torch reference.

Shapes: Qwen3.5-35B-A3B attention (16 q heads / 2 kv heads of 256, partial rotary 64), q the first
half of q_proj's [B, T, H, 2K] output (q and the output gate: a strided view, as in the model), and
Qwen3-30B-A3B (32 / 4 heads of 128, full rotary, contiguous q); bf16 q, k, cos, sin. "fwd_bwd" also
takes the gradients of sum(q_out * dq + k_out * dk) with respect to q and k as the op receives them
(`torch.autograd.grad` at the strided q view): the op's backward only, without autograd's zero-filled
[T, H, 2K] gradient of the projection and the copy into its first half (about 0.54 GB of traffic at
T=16384, the same for every provider; in the model that gradient is assembled by the split's backward).

Liger 0.8.5's rope (`liger_kernel.transformers.rope.liger_rotary_pos_emb`, q/k as [B, H, T, K]
views; partial rotary from the cos width) rotates q/k in place after `.contiguous()` (so a strided q
is copied first), and its backward rotates the incoming gradients in place. "liger" clones what it
would overwrite (contiguous q/k and the cotangents: shared benchmark inputs), so its time includes
those copies and its outputs are checked; "liger_inplace" rotates private buffers over and over:
the kernel alone, timed only (nothing to check). Ours writes new tensors: the same one read and one
write of q/k as an in-place rotation.
Outputs, in order: q, k (+ dq, dk); "torch" (the reference) is the golden.
"""

from __future__ import annotations

import torch
from verl_moe.ops.dispatch import unrunnable_reason

CASES = [
    {"id": "qwen3.5-T8192-H16-HKV2-K256-R64", "T": 8192, "H": 16, "HKV": 2, "K": 256, "R": 64, "gate": True},
    {"id": "qwen3.5-T16384-H16-HKV2-K256-R64", "T": 16384, "H": 16, "HKV": 2, "K": 256, "R": 64, "gate": True},
    {"id": "qwen3moe-T16384-H32-HKV4-K128-R128", "T": 16384, "H": 32, "HKV": 4, "K": 128, "R": 128, "gate": False},
]
PROVIDERS = ("triton", "liger", "liger_inplace", "torch")
REFERENCE = "torch"
MODES = ("fwd", "fwd_bwd")
# rel RMS vs the bf16 reference: ours rounds once from fp32, the reference after each product and
# the sum (about one bf16 ulp apart); Liger computes in bf16.
TOLERANCE = {"triton": 1e-2, "liger": 1e-2, "liger_inplace": 0.0, "torch": 0.0}


def unavailable(provider: str) -> str | None:
    """Why `provider` cannot run in this process, or None ("liger_inplace" is Liger's kernel)."""
    if provider not in PROVIDERS:
        return f"unknown provider {provider!r}"
    return unrunnable_reason(provider.removesuffix("_inplace"), interpreter=False)


def make_inputs(case: dict, device: torch.device) -> dict:
    """Leaves "qg" ([1, T, H, 2K], q = its first K features) or "q" ([1, T, H, K]), and k
    [1, T, HKV, K]; cos/sin from positions 0..T-1; fixed output cotangents; all bf16."""
    from verl_moe.ops.rope.reference import rope_cos_sin, rope_inv_freq

    gen = torch.Generator(device="cpu").manual_seed(0)
    T, H, HKV, K, R = (case[n] for n in ("T", "H", "HKV", "K", "R"))

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)

    pos = torch.arange(T, device=device)[None]
    cos, sin = rope_cos_sin(pos, rope_inv_freq(K, 1e7, R / K, device=device), dtype=torch.bfloat16)
    q_leaf = ("qg", rnd(1, T, H, 2 * K)) if case["gate"] else ("q", rnd(1, T, H, K))
    return {
        q_leaf[0]: q_leaf[1].requires_grad_(),
        "k": rnd(1, T, HKV, K).requires_grad_(),
        "cos": cos,
        "sin": sin,
        "dq": rnd(1, T, H, K),
        "dk": rnd(1, T, HKV, K),
    }


def _q_leaf(inputs: dict) -> torch.Tensor:
    return inputs["qg"] if "qg" in inputs else inputs["q"]


def _liger(q, k, cos, sin):
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    qr, kr = liger_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return qr.transpose(1, 2), kr.transpose(1, 2)


def _run_liger_inplace(inputs: dict, mode: str) -> list[torch.Tensor]:
    K = inputs["k"].shape[-1]
    if "_liger" not in inputs:  # private buffers, rotated again on every call
        inputs["_liger"] = {
            "q": _q_leaf(inputs).detach().clone().requires_grad_(),
            "k": inputs["k"].detach().clone().requires_grad_(),
            "dq": inputs["dq"].clone(),
            "dk": inputs["dk"].clone(),
        }
    p = inputs["_liger"]
    q = p["q"][..., :K]
    if mode == "fwd":
        with torch.no_grad():
            _liger(q, p["k"], inputs["cos"], inputs["sin"])
        return []
    q_out, k_out = _liger(q, p["k"], inputs["cos"], inputs["sin"])
    torch.autograd.grad([q_out, k_out], [q, p["k"]], [p["dq"], p["dk"]])
    return []


def run(provider: str, inputs: dict, mode: str) -> list[torch.Tensor]:
    """One call; for "fwd_bwd" also the backward. Returns [q, k] (+ dq, dk)."""
    if provider == "liger_inplace":
        return _run_liger_inplace(inputs, mode)
    leaf, k, cos, sin = _q_leaf(inputs), inputs["k"], inputs["cos"], inputs["sin"]
    q = leaf[..., : k.shape[-1]]
    dq, dk = inputs["dq"], inputs["dk"]
    if provider == "liger":
        q = q if not q.is_contiguous() else q.clone()  # a strided q is copied by Liger itself
        k, dq, dk = k.clone(), dq.clone(), dk.clone()
        call = _liger
    else:
        from verl_moe.ops.rope import apply_rotary_pos_emb

        def call(q, k, cos, sin):
            return apply_rotary_pos_emb(q, k, cos, sin, impl=provider)

    if mode == "fwd":
        with torch.no_grad():
            return list(call(q, k, cos, sin))
    q_out, k_out = call(q, k, cos, sin)
    dq_in, dk_in = torch.autograd.grad([q_out, k_out], [q, k], [dq, dk])
    return [q_out.detach(), k_out.detach(), dq_in, dk_in]
