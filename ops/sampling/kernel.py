"""The sampling op in one Triton kernel (`resolve("sampling")`'s "triton", the cuda/npu default); contract
as `reference.sample_tokens_ref`.

One program per row (1-D grid, looping over rows past 65535) reads the row's logits twice: pass 1 keeps a
running max, the sum of exp(x - max) and the first argmax; pass 2 walks the blocks again with an fp64
running CDF (each block's prefix as an fp64 scan) and keeps the first token whose CDF exceeds
uniform x total. No [N, VOCAB] tensor is written: a decode step at 256 rows x 248k tokens reads the
logits twice instead of moving ~12 copies of them through log-softmax, exp and the CDF.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.launch import grid_1d, launch
from .reference import check_sampling_inputs

SAMPLE_CONFIGS = [
    {"BLOCK": 4096, "num_warps": 8},
    {"BLOCK": 2048, "num_warps": 4},
]
MAX_SHAPES = ({"N": 4096, "V": 262144},)


@triton.jit
def _sample_kernel(logits, temperature, greedy, uniform, tokens, logprobs, N, V, stride, BLOCK: tl.constexpr):
    i_p, n_p = tl.program_id(0), tl.num_programs(0)
    o = tl.arange(0, BLOCK)
    for row in range(i_p, N, n_p):
        base = logits + tl.cast(row, tl.int64) * stride
        inv_t = 1.0 / tl.load(temperature + row).to(tl.float32)
        m = tl.full([], float("-inf"), tl.float32)
        s = tl.zeros([], tl.float32)
        best = tl.full([], float("-inf"), tl.float32)
        best_i = tl.zeros([], tl.int64)
        for start in range(0, V, BLOCK):
            mask = start + o < V
            x = tl.load(base + start + o, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
            bm = tl.max(x, 0)
            bi = tl.argmax(x, 0).to(tl.int64) + start
            best_i = tl.where(bm > best, bi, best_i)  # strictly greater: the first maximum wins
            best = tl.maximum(best, bm)
            m_new = tl.maximum(m, bm)
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        target = tl.load(uniform + row) * s.to(tl.float64)
        cdf = tl.zeros([], tl.float64)
        drawn = tl.full([], -1, tl.int64)
        last = tl.full([], -1, tl.int64)  # the last token of positive weight
        for start in range(0, V, BLOCK):
            mask = start + o < V
            x = tl.load(base + start + o, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
            p = tl.exp(x - m)
            c = cdf + tl.cumsum(p.to(tl.float64), 0)
            first = tl.min(tl.where((c > target) & mask, start + o, V), 0).to(tl.int64)
            drawn = tl.where((drawn < 0) & (first < V), first, drawn)
            last = tl.maximum(last, tl.max(tl.where(mask & (p > 0), start + o, -1), 0).to(tl.int64))
            cdf = tl.max(tl.where(mask, c, 0.0), 0)
        drawn = tl.where(drawn < 0, last, drawn)  # u x total rounded up to the total: as a target just below it
        token = tl.where(tl.load(greedy + row) != 0, best_i, drawn)
        lp = tl.load(base + token).to(tl.float32) * inv_t - m - tl.log(s)
        tl.store(tokens + row, token)
        tl.store(logprobs + row, lp)


def _grid(meta: dict) -> tuple[int]:
    return grid_1d(meta["N"])


KERNEL_LAUNCHES = {
    "_sample_kernel": {
        "configs": SAMPLE_CONFIGS,
        "meta": lambda shape: {},
        "grid": _grid,
        "runtime": lambda shape: {},
        "max_shapes": MAX_SHAPES,
    },
}


def sample_tokens_triton(
    logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, uniform: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_tokens_ref` in one kernel; raises ValueError as it does."""
    check_sampling_inputs(logits, temperature, greedy, uniform)
    N, V = logits.shape
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    tokens = torch.empty(N, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N == 0:
        return tokens, logprobs
    launch(
        _sample_kernel,
        SAMPLE_CONFIGS,
        ["V"],
        _grid,
        logits=logits,
        temperature=temperature.float().contiguous(),
        greedy=greedy.contiguous().view(torch.uint8),
        uniform=uniform.contiguous(),
        tokens=tokens,
        logprobs=logprobs,
        N=N,
        V=V,
        stride=logits.stride(0),
    )
    return tokens, logprobs


__all__ = ["KERNEL_LAUNCHES", "sample_tokens_triton"]
