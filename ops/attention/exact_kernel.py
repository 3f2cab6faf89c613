"""Exact mode's attention on devices: `exact.attention_rows`'s contract in one Triton kernel, which the
trainer's packed forward, the prefill (whole or chunked) and the decode step all launch.

A program owns one query row's group of G heads that share a KV head, and one block of value columns. It
walks the row's visible positions in tiles of TILE counted from the row's own start, with an online softmax
(running max, sum and output, rescaled per tile) over scores from tensor-core dots whose M is always the
padded group BG: every row goes through the same instructions with the same operands, whether it is one
token of a packed batch of thousands or one decode slot of a step, so its output is bitwise the same.
Visible positions are only ever read, so the cache's capacity and the other rows do not enter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.launch import cdiv, dot_dtype, dot_precision, grid_1d, launch, next_pow2

TILE = 64  # positions per online-softmax tile
BLOCK_D = 128  # head-dim block of a score dot and of the value columns one program writes
CONFIG = {"num_warps": 4, "num_stages": 2}
MAX_SHAPES = ({"R": 1 << 16, "HKV": 16, "G": 16, "K": 256, "V": 256},)


@triton.jit(do_not_specialize=["R"])
def _attention_rows_kernel(
    q,
    k_cache,
    v_cache,
    o,
    slot,
    start,
    count,
    scale,
    R,
    s_qr,
    s_qh,
    s_ks,
    s_kh,
    s_kl,
    s_vs,
    s_vh,
    s_vl,
    s_or,
    s_oh,
    HKV: tl.constexpr,
    G: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BG: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    TILE: tl.constexpr,
    DT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """o[r, h*G:(h+1)*G, value block] for every (row r, KV head h, value block) of a grid-stride loop."""
    i_p, n_p = tl.program_id(0), tl.num_programs(0)
    NV = tl.cdiv(V, BV)
    o_g = tl.arange(0, BG)
    o_t = tl.arange(0, TILE)
    m_g = o_g < G
    for i_w in range(i_p, R * HKV * NV, n_p):
        i_rh, i_v = i_w // NV, i_w % NV
        i_r, i_h = i_rh // HKV, i_rh % HKV
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        n_pos = tl.load(count + i_r)
        p_k = k_cache + tl.load(slot + i_r).to(tl.int64) * s_ks + i_h * s_kh + tl.load(start + i_r).to(tl.int64) * s_kl
        p_v = v_cache + tl.load(slot + i_r).to(tl.int64) * s_vs + i_h * s_vh + tl.load(start + i_r).to(tl.int64) * s_vl
        p_q = q + i_r.to(tl.int64) * s_qr + (i_h * G + o_g)[:, None] * s_qh
        b_m = tl.full([BG], float("-inf"), dtype=tl.float32)
        b_l = tl.zeros([BG], dtype=tl.float32)
        b_acc = tl.zeros([BG, BV], dtype=tl.float32)
        for j in range(0, n_pos, TILE):
            m_t = (j + o_t) < n_pos
            b_s = tl.zeros([BG, TILE], dtype=tl.float32)
            for d0 in range(0, K, BK):
                o_d = d0 + tl.arange(0, BK)
                m_d = o_d < K
                b_q = tl.load(p_q + o_d[None, :], mask=m_g[:, None] & m_d[None, :], other=0.0)
                b_k = tl.load(
                    p_k + (j + o_t)[None, :] * s_kl + o_d[:, None], mask=m_d[:, None] & m_t[None, :], other=0.0
                )
                b_s = tl.dot(b_q.to(DT), b_k.to(DT), b_s, input_precision=DOT_PREC)
            b_s = tl.where(m_t[None, :], b_s * scale, float("-inf"))
            b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
            b_alpha = tl.exp(b_m - b_m_new)
            b_p = tl.exp(b_s - b_m_new[:, None])
            b_l = b_l * b_alpha + tl.sum(b_p, 1)
            b_vt = tl.load(p_v + (j + o_t)[:, None] * s_vl + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
            b_acc = b_acc * b_alpha[:, None]
            b_acc = tl.dot(b_p.to(DT), b_vt.to(DT), b_acc, input_precision=DOT_PREC)
            b_m = b_m_new
        p_o = o + i_r.to(tl.int64) * s_or + (i_h * G + o_g)[:, None] * s_oh + o_v[None, :]
        tl.store(p_o, (b_acc / b_l[:, None]).to(o.dtype.element_ty), mask=m_g[:, None] & m_v[None, :])


def _meta(shape: dict) -> dict:
    return {
        "BG": next_pow2(shape["G"]),
        "BK": min(next_pow2(shape["K"]), BLOCK_D),
        "BV": min(next_pow2(shape["V"]), BLOCK_D),
        "TILE": TILE,
    }


def _grid(meta: dict) -> tuple[int]:
    return grid_1d(meta["R"] * meta["HKV"] * cdiv(meta["V"], meta["BV"]))


KERNEL_LAUNCHES = {
    "_attention_rows_kernel": {
        "configs": [CONFIG],
        "meta": _meta,
        "grid": _grid,
        "runtime": lambda shape: {},
        "max_shapes": MAX_SHAPES,
    },
}


def attention_rows_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: torch.Tensor,
    start: torch.Tensor,
    count: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`exact.attention_rows`'s contract: q [R, H, K]; k_cache [S, HKV, L, K], v_cache [S, HKV, L, V] (any
    strides with a unit last one); slot, start, count [R] int with count >= 1 and start + count <= L.
    Returns [R, H, V] in q's dtype (fp32 softmax; 16-bit tensor-core dots for 16-bit inputs)."""
    R, H, K = q.shape
    HKV, V = k_cache.shape[1], v_cache.shape[-1]
    if q.dtype == torch.float64:
        raise ValueError("the Triton exact attention computes in fp32: use the torch form for fp64")
    q = q if q.stride(-1) == 1 else q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a unit stride in their last dim")
    o = torch.empty(R, H, V, dtype=q.dtype, device=q.device)
    if R == 0:
        return o
    shape = {"G": H // HKV, "K": K, "V": V}
    launch(
        _attention_rows_kernel,
        [CONFIG],
        ["HKV", "G", "K", "V"],
        _grid,
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        o=o,
        slot=slot.contiguous(),  # one per row at row * 1
        start=start.contiguous(),
        count=count.contiguous(),
        scale=float(scale),
        R=R,
        s_qr=q.stride(0),
        s_qh=q.stride(1),
        s_ks=k_cache.stride(0),
        s_kh=k_cache.stride(1),
        s_kl=k_cache.stride(2),
        s_vs=v_cache.stride(0),
        s_vh=v_cache.stride(1),
        s_vl=v_cache.stride(2),
        s_or=o.stride(0),
        s_oh=o.stride(1),
        HKV=HKV,
        **shape,
        DT=dot_dtype(q.dtype),
        DOT_PREC=dot_precision(q.dtype),
        **_meta(shape),
    )
    return o


__all__ = ["attention_rows_triton"]
