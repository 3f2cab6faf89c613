"""Can exact mode's projections split K and stay batch-invariant? A prototype measured against the fixed-tile
GEMM exact mode uses (`ops/linear/exact_kernel.py`) and cuBLAS.

At a decode step's 256 rows a projection to N = 2048 outputs from K = 4096 has 2 x 32 output tiles of 128 x 64,
fewer than a large GPU has SMs, where cuBLAS splits K (timings: docs/exact.md, results/). Splitting K is
batch-invariant when the split is fixed (never chosen by the row count) and both paths sum the parts in one
order: each part accumulates its K range from zero in BK steps, and the row's result is part 0 + part 1 + ...
in that order. Two forms compute exactly that:

- `split`: one program per (output tile, part) writes its fp32 part, then a second kernel adds the parts in
  order and rounds (the form for few rows: SPLIT times as many programs);
- `fused`: one program per output tile runs the parts one after the other in registers and adds them in the
  same order (the form for many rows: no fp32 parts through memory).

The script checks that both forms give every row the same bits (the decode step's 256 rows as a batch of
their own and inside a training micro-batch of 16,384) and times them against exact mode's kernel and cuBLAS per
projection shape of the reduced Qwen3.5-MoE, one JSON record per line.

python benchmarks/exact_split_k.py [layers]        # on a GPU
TRITON_INTERPRET=1 python benchmarks/exact_split_k.py --tiny   # the bitwise check at small sizes on CPU
"""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl
from verl_moe.ops.common.launch import dot_dtype, dot_precision


@triton.jit
def _part_rows(x, w, M, N, K, s_xm, s_wn, i_m, i_n, part, KS, BM, BN, BK, DT, DOT_PREC):
    """The fp32 [BM, BN] sum over K range [part * KS, (part + 1) * KS) of output tile (i_m, i_n), from zero."""
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    k_end = tl.minimum(K, (part + 1) * KS)
    for k0 in range(part * KS, k_end, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < k_end
        m_x = (o_m < M)[:, None] & m_k[None, :]
        m_w = m_k[:, None] & (o_n < N)[None, :]
        b_x = tl.load(x + o_m[:, None].to(tl.int64) * s_xm + o_k[None, :], mask=m_x, other=0.0)
        b_w = tl.load(w + o_n[None, :].to(tl.int64) * s_wn + o_k[:, None], mask=m_w, other=0.0)
        acc = tl.dot(b_x.to(DT), b_w.to(DT), acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _split_parts_kernel(
    x, w, parts, M, N, K, s_xm, s_wn, KS, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DT: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    tiles_n = tl.cdiv(N, BN)
    tiles = tl.cdiv(M, BM) * tiles_n
    i_p = tl.program_id(0)
    part, i_t = i_p // tiles, i_p % tiles
    i_m, i_n = i_t // tiles_n, i_t % tiles_n
    acc = _part_rows(x, w, M, N, K, s_xm, s_wn, i_m, i_n, part, KS, BM, BN, BK, DT, DOT_PREC)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    p = parts + part.to(tl.int64) * M * N + o_m[:, None].to(tl.int64) * N + o_n[None, :]
    tl.store(p, acc, mask=(o_m < M)[:, None] & (o_n < N)[None, :])


@triton.jit
def _sum_parts_kernel(parts, y, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < MN
    acc = tl.load(parts + o, mask=m, other=0.0)
    for part in tl.static_range(1, SPLIT):
        acc += tl.load(parts + part * MN + o, mask=m, other=0.0)
    tl.store(y + o, acc.to(y.dtype.element_ty), mask=m)


@triton.jit
def _fused_kernel(
    x, w, y, M, N, K, s_xm, s_wn, KS, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, DT: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    tiles_n = tl.cdiv(N, BN)
    i_t = tl.program_id(0)
    i_m, i_n = i_t // tiles_n, i_t % tiles_n
    total = _part_rows(x, w, M, N, K, s_xm, s_wn, i_m, i_n, 0, KS, BM, BN, BK, DT, DOT_PREC)
    for part in tl.static_range(1, SPLIT):
        total += _part_rows(x, w, M, N, K, s_xm, s_wn, i_m, i_n, part, KS, BM, BN, BK, DT, DOT_PREC)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    p = y + o_m[:, None].to(tl.int64) * N + o_n[None, :]
    tl.store(p, total.to(y.dtype.element_ty), mask=(o_m < M)[:, None] & (o_n < N)[None, :])


def _part_width(K: int, split: int, bk: int) -> int:
    """K per part: a whole number of BK steps, so every part walks its range in the same steps."""
    return triton.cdiv(triton.cdiv(K, split), bk) * bk


def split_linear(x, w, split: int, fused: bool, bm: int = 64, bn: int = 64, bk: int = 64, warps: int = 4):
    """x [M, K] @ w [N, K].T with K in `split` fixed parts summed in order, as `split` or `fused` form."""
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    ks = _part_width(K, split, bk)
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    meta = dict(BM=bm, BN=bn, BK=bk, DT=dot_dtype(x.dtype), DOT_PREC=dot_precision(x.dtype), num_warps=warps)
    if fused:
        _fused_kernel[(tiles,)](x, w, y, M, N, K, x.stride(0), w.stride(0), ks, SPLIT=split, **meta)
        return y
    parts = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    _split_parts_kernel[(tiles * split,)](x, w, parts, M, N, K, x.stride(0), w.stride(0), ks, **meta)
    _sum_parts_kernel[(triton.cdiv(M * N, 1024),)](parts, y, M * N, SPLIT=split, BLOCK=1024)
    return y


def check(M: int, big: int, N: int, K: int, split: int, dtype, dev) -> bool:
    """Whether the split form over M rows and the fused form over `big` rows (the M among them) agree bitwise."""
    x = torch.randn(big, K, device=dev).to(dtype)
    w = (torch.randn(N, K, device=dev) / K**0.5).to(dtype)
    few = split_linear(x[:M].contiguous(), w, split, fused=False)
    many = split_linear(x, w, split, fused=True, bm=128 if dev.type == "cuda" else 64)
    return torch.equal(few, many[:M])


def timed(fn, *args, **kwargs) -> float:
    """Milliseconds of one fn(*args, **kwargs) on the device (triton's do_bench)."""
    from triton.testing import do_bench

    return do_bench(lambda: fn(*args, **kwargs))


def main() -> None:
    if "--tiny" in sys.argv:  # the interpreter: the bitwise check only (K = 600: parts of 320 or 256 columns)
        for split in (1, 2, 3):
            same = check(5, 37, 70, 600, split, torch.float32, torch.device("cpu"))
            print(json.dumps({"split": split, "same_bits": same}))
        return
    from verl_moe.models import build
    from verl_moe.ops.linear import exact_kernel
    from verl_moe.tools.bench.model import reduced_config

    dev = torch.device("cuda")
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    torch.manual_seed(0)
    model = build(reduced_config(layers), dtype=torch.bfloat16, device=dev)
    shapes: dict[tuple, int] = {}
    for name, p in model.named_parameters():
        if p.dim() == 2 and "embed" not in name and "lm_head" not in name:
            shapes[tuple(p.shape)] = shapes.get(tuple(p.shape), 0) + 1
    for (N, K), count in shapes.items():
        w = next(p for p in model.parameters() if tuple(p.shape) == (N, K))
        record = {"N": N, "K": K, "count": count}
        for split in (2, 4):
            record[f"same_bits_split{split}"] = check(256, 16384, N, K, split, torch.bfloat16, dev)
        for rows in (256, 16384):
            a = torch.randn(rows, K, device=dev, dtype=torch.bfloat16)
            ms = {
                "cublas": timed(torch.nn.functional.linear, a, w),
                "exact": timed(exact_kernel.linear_rows_triton, a, w),
            }
            for split in (2, 4):
                ms[f"split{split}"] = timed(split_linear, a, w, split, fused=False)
                ms[f"fused{split}"] = timed(split_linear, a, w, split, fused=True, bm=128, bn=128, warps=8)
            record[f"ms_{rows}"] = {k: v * count for k, v in ms.items()}
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
