"""Long-sequence causal GQA attention on a CUDA GPU: time and memory of the ways to run it.

    python benchmarks/attention_memory.py [--tokens 32768] [--json F]

Qwen3.5-MoE's attention shapes (16 query heads, 2 key/value heads, head dim 256, bf16), one sequence,
forward + backward. Rows: K/V repeated to 16 heads then SDPA (cuDNN on Hopper),
SDPA with enable_gqa under each backend, flash attention's varlen kernel (native GQA), and the last
half of the queries against all keys (a query tile: causal from the bottom right) through flash
varlen and SDPA with a lower-right causal bias. Each row: median ms of 5, the peak allocated above
q/k/v and the upstream gradient, and the max |diff| of its output against the first row's rows.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

H, HKV, K = 16, 2, 256


def repeat_sdpa(q, k, v):
    g = H // HKV
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(g, 2).transpose(1, 2), v.repeat_interleave(g, 2).transpose(1, 2),
        is_causal=True,
    ).transpose(1, 2)  # fmt: skip


def gqa_sdpa(q, k, v):
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)


def forced(backend, fn):
    """fn with SDPA restricted to `backend`."""

    def run(*args):
        with sdpa_kernel([backend]):
            return fn(*args)

    return run


class FlashTail(torch.autograd.Function):
    """q [Tq, H, K] the last Tq of k/v's Tk positions: one sequence, causal from the bottom right."""

    @staticmethod
    def forward(ctx, q, k, v):
        Tq, Tk = q.shape[0], k.shape[0]
        cq = torch.tensor([0, Tq], dtype=torch.int32, device=q.device)
        ck = torch.tensor([0, Tk], dtype=torch.int32, device=q.device)
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cq, ck, Tq, Tk, 0.0, True, False, scale=K**-0.5
        )
        ctx.save_for_backward(q, k, v, out, lse, cq, ck, seed, offset)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, cq, ck, seed, offset = ctx.saved_tensors
        Tq, Tk = q.shape[0], k.shape[0]
        return torch.ops.aten._flash_attention_backward(
            do.contiguous(), q, k, v, out, lse, cq, ck, Tq, Tk, 0.0, True, seed, offset, scale=K**-0.5
        )


def flash(q, k, v):
    return FlashTail.apply(q[0], k[0], v[0])[None]


def tile_bias(q, k, v):
    """q the last q.shape[1] of the keys' positions: K/V repeated, a lower-right causal bias."""
    g = H // HKV
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(g, 2).transpose(1, 2),
        v.repeat_interleave(g, 2).transpose(1, 2), attn_mask=causal_lower_right(q.shape[1], k.shape[1]),
    ).transpose(1, 2)  # fmt: skip


def measure(fn, q, k, v, backward=True):
    dout = torch.randn_like(q)
    for _ in range(2):
        o = fn(q, k, v)
        if backward:
            torch.autograd.grad(o, (q, k, v), dout)
    torch.cuda.synchronize()
    times = []
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(5):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        o = fn(q, k, v)
        if backward:
            torch.autograd.grad(o, (q, k, v), dout)
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    peak = (torch.cuda.max_memory_allocated() - base) / 1024**3
    return sorted(times)[2], peak, o.detach()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--json")
    a = p.parse_args()
    T = a.tokens
    torch.manual_seed(0)
    dev = torch.device("cuda")
    q = torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, T, HKV, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, T, HKV, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    rows, ref = [], None
    cases = [
        ("repeat + sdpa (default backend)", repeat_sdpa, True, False),
        ("repeat + sdpa cudnn", forced(SDPBackend.CUDNN_ATTENTION, repeat_sdpa), True, False),
        ("gqa sdpa cudnn", forced(SDPBackend.CUDNN_ATTENTION, gqa_sdpa), True, False),
        ("gqa sdpa flash", forced(SDPBackend.FLASH_ATTENTION, gqa_sdpa), True, False),
        ("gqa sdpa efficient", forced(SDPBackend.EFFICIENT_ATTENTION, gqa_sdpa), True, False),
        ("flash varlen", flash, True, False),
        ("tile: last half of q, flash varlen", flash, True, True),
        ("tile: last half of q, lower-right bias cudnn", forced(SDPBackend.CUDNN_ATTENTION, tile_bias), True, True),
        (
            "tile: last half of q, lower-right bias efficient",
            forced(SDPBackend.EFFICIENT_ATTENTION, tile_bias),
            True,
            True,
        ),
        ("tile: last half of q, lower-right bias flash", forced(SDPBackend.FLASH_ATTENTION, tile_bias), True, True),
    ]
    for name, fn, backward, tile in cases:
        qq = q[:, T // 2 :].detach().requires_grad_() if tile else q
        try:
            ms, peak, o = measure(fn, qq, k, v, backward)
        except Exception as e:  # a backend that does not take these inputs
            rows.append({"case": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})
            print(f"{name:52s} error {rows[-1]['error']}")
            continue
        if ref is None:
            ref = o
        diff = (o.float() - ref[:, -o.shape[1] :].float()).abs().max().item()
        rows.append({"case": name, "ms": ms, "peak_gib": peak, "max_abs_diff": diff, "backward": backward})
        print(f"{name:52s} {ms:8.2f} ms  peak +{peak:6.3f} GiB  max|diff| {diff:.2e}")
        del o
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"tokens": T, "heads": [H, HKV, K], "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
