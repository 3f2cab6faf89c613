"""Benchmark cases for `verl-moe bench gdn`: our Triton kernels against fla and transformers' torch.

Qwen3.5-35B-A3B linear-attention shapes: H=16 q/k heads, HV=32 value heads, K=V=128, bf16 q/k/v
and beta, fp32 g, q/k l2-normalised in the op. "torch" is transformers' `torch_chunk_gated_delta_rule`
(fp32 inside, q/k repeated to HV heads, one call per sequence: it ignores packing), also the
golden of the correctness check; it is too slow to check the 64K-token case.
"""

from __future__ import annotations

import os

import torch
from verl_moe.ops.dispatch import unrunnable_reason

CASES = [
    {"id": "B1-T4096-H16-HV32", "B": 1, "T": 4096},
    {"id": "B1-T16384-H16-HV32", "B": 1, "T": 16384},
    {"id": "B1-T65536-H16-HV32", "B": 1, "T": 65536, "check": False},
    {"id": "B4-T8192-H16-HV32", "B": 4, "T": 8192},
    {"id": "varlen8-T16384-H16-HV32", "B": 1, "T": 16384, "varlen": 8},
]
for _case in CASES:
    _case.update(H=16, HV=32, K=128, V=128)
PROVIDERS = ("triton", "fla", "torch")
REFERENCE = "torch"
MODES = ("fwd", "fwd_bwd")
# Max relative RMS error over o and the gradients against the fp32 torch reference: bf16 storage,
# with dg/dbeta the loosest (see tests/ops/test_gdn.py).
TOLERANCE = {"triton": 2e-2, "fla": 2e-2, "torch": 0.0}


def unavailable(provider: str) -> str | None:
    """Why `provider` cannot run in this process, or None."""
    if provider not in PROVIDERS:
        return f"unknown provider {provider!r}"
    return unrunnable_reason(provider, interpreter=False)


def make_inputs(case: dict, device: torch.device) -> dict:
    """Leaf tensors (requires_grad) for one case, a fixed output cotangent, and cu_seqlens."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    B, T, H, HV, K, V = (case[n] for n in ("B", "T", "H", "HV", "K", "V"))

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    x = {
        "q": rnd(B, T, H, K).bfloat16(),
        "k": rnd(B, T, H, K).bfloat16(),
        "v": rnd(B, T, HV, V).bfloat16(),
        "g": torch.nn.functional.logsigmoid(rnd(B, T, HV)),
        "beta": torch.sigmoid(rnd(B, T, HV)).bfloat16(),
    }
    for t in x.values():
        t.requires_grad_()
    x["do"] = rnd(B, T, HV, V).bfloat16()
    x["cu_seqlens"] = None
    if case.get("varlen"):
        cuts = torch.randperm(T - 1, generator=gen)[: case["varlen"] - 1].add(1).sort().values.tolist()
        x["cu_seqlens"] = torch.tensor([0, *cuts, T], dtype=torch.int32, device=device)
    return x


def _ours(x):
    from verl_moe.ops.gdn.chunk import chunk_gated_delta_rule

    return chunk_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu_seqlens"]
    )[0]


def _fla(x):
    os.environ.setdefault("FLA_FLASH_QLA", "0")  # fla's Triton path, not its optional CUDA backend
    import fla.ops.common.chunk_o as fla_chunk_o
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    # fla 0.6 refuses its backward on Hopper with Triton < 3.7.1 (its guard against a miscompile at
    # some tile sizes); the runner checks its gradients against the reference before timing.
    fla_chunk_o.TRITON_ABOVE_3_7_1 = True
    return chunk_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu_seqlens"]
    )[0]


def _torch(x):
    import inspect

    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

    # Newer transformers wrap this function in a decorator that dispatches to fla when fla is
    # installed (as it is here, for the fla provider); unwrap to time the torch code itself.
    torch_chunk_gated_delta_rule = inspect.unwrap(modeling_qwen3_5_moe.torch_chunk_gated_delta_rule)
    group = x["v"].shape[2] // x["q"].shape[2]
    q, k = (t.repeat_interleave(group, dim=2) for t in (x["q"], x["k"]))
    cu = x["cu_seqlens"].tolist() if x["cu_seqlens"] is not None else [0, x["q"].shape[1]]
    outs = [
        torch_chunk_gated_delta_rule(
            q[:, s:e], k[:, s:e], x["v"][:, s:e], x["g"][:, s:e], x["beta"][:, s:e], use_qk_l2norm_in_kernel=True
        )[0]
        for s, e in zip(cu[:-1], cu[1:])
    ]
    return torch.cat(outs, dim=1)


def run(provider: str, inputs: dict, mode: str) -> list[torch.Tensor]:
    """One call; for "fwd_bwd" also the backward of sum(o * do). Returns [o] (+ dq, dk, dv, dg, dbeta)."""
    fn = {"triton": _ours, "fla": _fla, "torch": _torch}[provider]
    leaves = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    if mode == "fwd":
        with torch.no_grad():
            return [fn(inputs)]
    for t in leaves:
        t.grad = None
    o = fn(inputs)
    o.backward(inputs["do"])
    return [o.detach()] + [t.grad for t in leaves]
