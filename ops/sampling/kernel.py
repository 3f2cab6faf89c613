"""The sampling op in two Triton kernels (`resolve("sampling")`'s "triton", the cuda/npu default); contract
as `reference.sample_tokens_ref`.

The vocabulary is cut into chunks of CHUNK tokens. Pass 1 (one program per row x chunk) reads its chunk of
x = logits / temperature once and keeps the chunk's max m_c, first argmax and fp64 sum of exp(x - m_c).
Pass 2 (one program per row) combines the row's chunk statistics (max, first argmax, the total, each chunk's
weight sum_c x exp(m_c - max)), finds the chunk whose fp64 running weight first exceeds uniform x total and
scans only that chunk: the first token whose CDF exceeds the target. A decode step at 256 rows x 248k tokens
thus reads its logits once across ~8k programs, instead of twice in 256. No [N, VOCAB] tensor is written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.launch import cdiv, grid_1d, launch, next_pow2
from .reference import check_sampling_inputs

CHUNK = 8192  # tokens per pass-1 program; the chunking, not the autotuner, fixes the order of the sums
STATS_CONFIGS = [{"num_warps": 8}, {"num_warps": 4}]
DRAW_CONFIGS = [{"num_warps": 8}, {"num_warps": 4}]
MAX_SHAPES = ({"N": 4096, "V": 262144},)


@triton.jit
def _chunk_stats_kernel(logits, temperature, chunk_max, chunk_arg, chunk_sum, N, V, stride, C, CHUNK: tl.constexpr):
    i_p, n_p = tl.program_id(0), tl.num_programs(0)
    o = tl.arange(0, CHUNK)
    for tile in range(i_p, N * C, n_p):
        row, c = tile // C, tile % C
        inv_t = 1.0 / tl.load(temperature + row).to(tl.float32)
        mask = c * CHUNK + o < V
        x = tl.load(logits + tl.cast(row, tl.int64) * stride + c * CHUNK + o, mask=mask, other=float("-inf"))
        x = x.to(tl.float32) * inv_t
        m = tl.max(x, 0)
        arg = tl.argmax(x, 0).to(tl.int64) + c * CHUNK  # the first maximum
        m_safe = tl.where(m == float("-inf"), 0.0, m)  # a chunk of -inf only: weight 0, not nan
        s = tl.sum(tl.exp(x - m_safe).to(tl.float64), 0)
        tl.store(chunk_max + tile, m)
        tl.store(chunk_arg + tile, arg)
        tl.store(chunk_sum + tile, s)


@triton.jit
def _draw_kernel(
    logits,
    temperature,
    greedy,
    uniform,
    chunk_max,
    chunk_arg,
    chunk_sum,
    tokens,
    logprobs,
    N,
    V,
    stride,
    C,
    CHUNK: tl.constexpr,
    BC: tl.constexpr,
):
    i_p, n_p = tl.program_id(0), tl.num_programs(0)
    o = tl.arange(0, CHUNK)
    o_c = tl.arange(0, BC)
    for row in range(i_p, N, n_p):
        base = logits + tl.cast(row, tl.int64) * stride
        inv_t = 1.0 / tl.load(temperature + row).to(tl.float32)
        m_c = tl.load(chunk_max + row * C + o_c, mask=o_c < C, other=float("-inf"))
        m = tl.max(m_c, 0)
        best_c = tl.min(tl.where(m_c == m, o_c, BC), 0)  # the first chunk holding the maximum
        best_i = tl.load(chunk_arg + row * C + best_c)
        scale = tl.exp(m_c - m)  # 0 for chunks of -inf and past C
        w = tl.load(chunk_sum + row * C + o_c, mask=o_c < C, other=0.0) * scale.to(tl.float64)
        ends = tl.cumsum(w, 0)
        total = tl.sum(w, 0)
        target = tl.load(uniform + row) * total
        # the chunk the target falls in; u x total rounded up to the total: the last chunk of weight
        c_star = tl.min(tl.where((ends > target) & (w > 0), o_c, BC), 0)
        c_star = tl.where(c_star == BC, tl.max(tl.where(w > 0, o_c, -1), 0), c_star)
        start = tl.sum(tl.where(o_c == c_star, ends - w, 0.0), 0)
        s_star = tl.sum(tl.where(o_c == c_star, scale, 0.0), 0)
        m_star = tl.sum(tl.where(o_c == c_star, m_c, 0.0), 0)
        local = (target - start) / s_star.to(tl.float64)  # the target in the chunk's own units
        mask = c_star * CHUNK + o < V
        x = tl.load(base + c_star * CHUNK + o, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
        p = tl.exp(x - m_star)
        cdf = tl.cumsum(p.to(tl.float64), 0)
        drawn = tl.min(tl.where((cdf > local) & mask, o, CHUNK), 0)
        drawn = tl.where(drawn == CHUNK, tl.max(tl.where(mask & (p > 0), o, -1), 0), drawn)
        drawn = drawn.to(tl.int64) + c_star * CHUNK
        token = tl.where(tl.load(greedy + row) != 0, best_i, drawn)
        lp = tl.load(base + token).to(tl.float32) * inv_t - m - tl.log(total.to(tl.float32))
        tl.store(tokens + row, token)
        tl.store(logprobs + row, lp)


def _stats_grid(meta: dict) -> tuple[int]:
    return grid_1d(meta["N"] * meta["C"])


def _draw_grid(meta: dict) -> tuple[int]:
    return grid_1d(meta["N"])


def _meta(shape: dict) -> dict:
    return {"CHUNK": CHUNK, "BC": next_pow2(cdiv(shape["V"], CHUNK))}


KERNEL_LAUNCHES = {
    "_chunk_stats_kernel": {
        "configs": STATS_CONFIGS,
        "meta": _meta,
        "grid": _stats_grid,
        "runtime": lambda shape: {"C": cdiv(shape["V"], CHUNK)},
        "max_shapes": MAX_SHAPES,
    },
    "_draw_kernel": {
        "configs": DRAW_CONFIGS,
        "meta": _meta,
        "grid": _draw_grid,
        "runtime": lambda shape: {"C": cdiv(shape["V"], CHUNK)},
        "max_shapes": MAX_SHAPES,
    },
}


def sample_tokens_triton(
    logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, uniform: torch.Tensor, chunk: int = CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_tokens_ref` in two kernels; raises ValueError as it does. chunk: tokens per pass-1 program
    (a power of two; tests take small ones to cross many chunks at small vocabularies)."""
    check_sampling_inputs(logits, temperature, greedy, uniform)
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    N, V = logits.shape
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    tokens = torch.empty(N, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N == 0:
        return tokens, logprobs
    C = cdiv(V, chunk)
    chunk_max = torch.empty(N, C, dtype=torch.float32, device=logits.device)
    chunk_arg = torch.empty(N, C, dtype=torch.long, device=logits.device)
    chunk_sum = torch.empty(N, C, dtype=torch.float64, device=logits.device)
    temperature = temperature.float().contiguous()
    shared = {"logits": logits, "temperature": temperature, "chunk_max": chunk_max, "chunk_arg": chunk_arg}
    shared.update(chunk_sum=chunk_sum, N=N, V=V, stride=logits.stride(0), C=C, CHUNK=chunk)
    launch(_chunk_stats_kernel, STATS_CONFIGS, ["V"], _stats_grid, **shared)
    launch(
        _draw_kernel,
        DRAW_CONFIGS,
        ["V"],
        _draw_grid,
        greedy=greedy.contiguous().view(torch.uint8),
        uniform=uniform.contiguous(),
        tokens=tokens,
        logprobs=logprobs,
        BC=next_pow2(C),
        **shared,
    )
    return tokens, logprobs


__all__ = ["CHUNK", "KERNEL_LAUNCHES", "sample_tokens_triton"]
