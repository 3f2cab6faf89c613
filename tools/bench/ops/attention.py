"""Benchmark cases for `verl-moe bench attention`: causal GQA over packed sequences, Qwen3.5-35B-A3B's
full-attention shapes (16 q heads / 2 kv heads of 256, bf16), 16,384 tokens as 1, 16 or 64 sequences
(random cut points, seeded).

Providers: "varlen" (ours: flash attention's varlen kernel, one call, no k/v repeat); "torch" (the
reference and golden: SDPA once per sequence on repeated k/v); "transformers_sdpa" (transformers'
`sdpa_attention_forward` as its packed-sequence path calls it: with more than one sequence a
[1, 1, T, T] block-diagonal causal bool mask, built once per case and not timed, and k/v repeated,
since its SDPA call takes enable_gqa only without a mask; one sequence: is_causal with enable_gqa);
"flex" (FlexAttention with a document mask, torch.compile'd: the first warm-up call compiles).
Outputs, in order: o (+ dq, dk, dv of sum(o * do)).
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import torch
from verl_moe.ops import device

CASES = [{"id": f"T16384-N{n}-H16-HKV2-K256", "T": 16384, "N": n, "H": 16, "HKV": 2, "K": 256} for n in (1, 16, 64)]
PROVIDERS = ("varlen", "torch", "transformers_sdpa", "flex")
REFERENCE = "torch"
MODES = ("fwd", "fwd_bwd")
# rel RMS vs the bf16 per-sequence SDPA: every provider rounds P and the output to bf16 in its own order
# The reference against itself: cuDNN's SDPA backward is not bitwise repeatable, hence not 0.
TOLERANCE = {"varlen": 1e-2, "torch": 1e-4, "transformers_sdpa": 1e-2, "flex": 1e-2}


def unavailable(provider: str) -> str | None:
    if provider not in PROVIDERS:
        return f"unknown provider {provider!r}"
    if provider == "varlen":
        if device.device_type() != "cuda":
            return "the varlen provider runs flash attention on cuda (its npu path is not benchmarked)"
        from verl_moe.ops.attention.varlen import flash_unavailable

        return flash_unavailable()
    if provider == "flex" and not device.is_accelerator():
        return "flex runs torch.compile'd on cuda here (eager CPU flex is forward only and unfused)"
    if provider == "transformers_sdpa" and importlib.util.find_spec("transformers") is None:
        return "transformers is not installed"
    return None


def make_inputs(case: dict, device: torch.device) -> dict:
    """Leaves q [1, T, H, K], k, v [1, T, HKV, K] (bf16, requires_grad), do, and cu_seqlens [N+1] int32."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    T, N, H, HKV, K = (case[n] for n in ("T", "N", "H", "HKV", "K"))

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)

    cuts = torch.randperm(T - 1, generator=gen)[: N - 1].add(1).sort().values.tolist()
    return {
        "q": rnd(1, T, H, K).requires_grad_(),
        "k": rnd(1, T, HKV, K).requires_grad_(),
        "v": rnd(1, T, HKV, K).requires_grad_(),
        "do": rnd(1, T, H, K),
        "cu_seqlens": torch.tensor([0, *cuts, T], dtype=torch.int32, device=device),
    }


def _packed_mask(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """[1, 1, T, T] bool: True where a query may attend (same sequence, not later)."""
    cu = cu_seqlens.long()
    doc = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device), cu[1:] - cu[:-1], output_size=T)
    pos = torch.arange(T, device=cu.device)
    return ((doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :]))[None, None]


def _transformers_sdpa(inputs: dict, scale: float) -> torch.Tensor:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v, cu = inputs["q"], inputs["k"], inputs["v"], inputs["cu_seqlens"]
    T, H = q.shape[1], q.shape[2]
    if cu.numel() > 2 and "_mask" not in inputs:  # built once per case, as the model builds it once per forward
        inputs["_mask"] = _packed_mask(cu, T)
    module = SimpleNamespace(num_key_value_groups=H // k.shape[2], is_causal=True)
    out, _ = sdpa_attention_forward(
        module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), inputs.get("_mask"), scaling=scale
    )
    return out


def _call(provider: str, inputs: dict) -> torch.Tensor:
    scale = inputs["q"].shape[-1] ** -0.5
    if provider == "transformers_sdpa":
        return _transformers_sdpa(inputs, scale)
    from verl_moe.ops.attention import causal_attention

    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    return causal_attention(q, k, v, scale=scale, cu_seqlens=inputs["cu_seqlens"], impl=provider)


def run(provider: str, inputs: dict, mode: str) -> list[torch.Tensor]:
    """One call; for "fwd_bwd" also the backward of sum(o * do). Returns [o] (+ dq, dk, dv)."""
    leaves = [inputs[n] for n in ("q", "k", "v")]
    if mode == "fwd":
        with torch.no_grad():
            return [_call(provider, inputs)]
    for t in leaves:
        t.grad = None
    o = _call(provider, inputs)
    o.backward(inputs["do"])
    return [o.detach()] + [t.grad for t in leaves]
