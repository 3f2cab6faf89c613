"""One-token attention over fixed-capacity caches in two Triton kernels (`resolve("attention.decode")`'s
"triton"); contract as `decode.decode_attention_ref`.

Pass 1, one program per (row, kv head, tile of BL positions): the group's G query heads against the tile's
keys (head dim in chunks of BK), the tile's softmax max m, sum l and unnormalised output p v (in chunks of
BV), stored as fp32 partials. A tile past the row's count loads and stores nothing (masked), so a row
moves only its visible tiles whatever the capacity. Pass 2, one program per (row, kv head, chunk of BV
output dims), combines the row's visible tiles: out = sum_t e^(m_t - M) acc_t / sum_t e^(m_t - M) l_t.
Tiles stay <= 128 x 128 (Ascend's unified buffer): the head dim is split rather than held whole.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.launch import cdiv, dot_dtype, dot_precision, grid_1d, launch, next_pow2
from .decode import check_decode_attention_inputs

BL = 128  # positions per pass-1 tile: the partials cost 2 G / BL of the K/V bytes read
TILE_CONFIGS = [{"num_warps": 4, "num_stages": 2}, {"num_warps": 8, "num_stages": 2}]
COMBINE_CONFIGS = [{"num_warps": 4}]
MAX_SHAPES = ({"B": 1024, "HKV": 8, "G": 16, "D": 256, "L": 32768},)


@triton.jit
def _decode_attention_tiles_kernel(
    q,
    k,
    v,
    counts,
    slots,
    m_part,
    l_part,
    acc_part,
    B,
    HKV,
    NT,
    scale,
    stride_ks,
    stride_kh,
    stride_kl,
    G: tl.constexpr,
    D: tl.constexpr,
    BG: tl.constexpr,
    BL: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
):
    i_p, n_p = tl.program_id(0), tl.num_programs(0)
    o_g = tl.arange(0, BG)
    m_g = o_g < G
    for item in range(i_p, B * HKV * NT, n_p):
        i_b, i_h, i_t = item // (HKV * NT), (item // NT) % HKV, item % NT
        count = tl.load(counts + i_b)
        o_l = i_t * BL + tl.arange(0, BL)
        m_l = o_l < count
        i_s = i_b  # the cache row this query row reads
        if HAS_SLOTS:
            i_s = tl.load(slots + i_b)
        kv_base = tl.cast(i_s, tl.int64) * stride_ks + tl.cast(i_h, tl.int64) * stride_kh
        q_rows = (tl.cast(i_b, tl.int64) * HKV + i_h) * G + o_g
        s = tl.zeros([BG, BL], dtype=tl.float32)
        for k0 in range(0, D, BK):
            o_k = k0 + tl.arange(0, BK)
            m_k = o_k < D
            b_q = tl.load(q + q_rows[:, None] * D + o_k[None, :], mask=m_g[:, None] & m_k[None, :], other=0.0)
            # keys read transposed through their strides: [BK, BL]
            b_kt = tl.load(
                k + kv_base + o_l[None, :] * stride_kl + o_k[:, None], mask=m_k[:, None] & m_l[None, :], other=0.0
            )
            s += tl.dot(b_q.to(DT), b_kt.to(DT), input_precision=DOT_PREC)
        s = tl.where(m_l[None, :], s * scale, float("-inf"))
        m = tl.max(s, 1)
        p = tl.exp(s - tl.where(m == float("-inf"), 0.0, m)[:, None])  # masked positions: 0
        part = tl.cast(item, tl.int64) * G + o_g
        # a tile past the count stores nothing (the count broadcast to a vector: the interpreter takes
        # no scalar mask term)
        keep = m_g & (o_g * 0 + count > i_t * BL)
        tl.store(m_part + part, m, mask=keep)
        tl.store(l_part + part, tl.sum(p, 1), mask=keep)
        for v0 in range(0, D, BV):
            o_v = v0 + tl.arange(0, BV)
            m_v = o_v < D
            b_v = tl.load(
                v + kv_base + o_l[:, None] * stride_kl + o_v[None, :], mask=m_l[:, None] & m_v[None, :], other=0.0
            )
            b_p = p * 1.0  # a fresh left operand per dot (Ascend's tl.dot may overwrite it)
            acc = tl.dot(b_p.to(DT), b_v.to(DT), input_precision=DOT_PREC)
            tl.store(acc_part + part[:, None] * D + o_v[None, :], acc, mask=keep[:, None] & m_v[None, :])


@triton.jit
def _decode_attention_combine_kernel(
    m_part,
    l_part,
    acc_part,
    counts,
    out,
    B,
    HKV,
    NT,
    G: tl.constexpr,
    D: tl.constexpr,
    BG: tl.constexpr,
    BL: tl.constexpr,
    BV: tl.constexpr,
):
    i_p, n_p = tl.program_id(0), tl.num_programs(0)
    NV = tl.cdiv(D, BV)
    o_g = tl.arange(0, BG)
    m_g = o_g < G
    for item in range(i_p, B * HKV * NV, n_p):
        i_bh, i_v = item // NV, item % NV
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < D
        n_tiles = tl.cdiv(tl.load(counts + i_bh // HKV), BL)
        base = tl.cast(i_bh, tl.int64) * NT
        m_all = tl.full([BG], float("-inf"), tl.float32)
        for t in range(0, n_tiles):
            m_all = tl.maximum(m_all, tl.load(m_part + (base + t) * G + o_g, mask=m_g, other=float("-inf")))
        m_safe = tl.where(m_g, m_all, 0.0)
        total = tl.zeros([BG], dtype=tl.float32)
        acc = tl.zeros([BG, BV], dtype=tl.float32)
        for t in range(0, n_tiles):
            part = (base + t) * G + o_g
            w = tl.exp(tl.load(m_part + part, mask=m_g, other=0.0) - m_safe)
            total += w * tl.load(l_part + part, mask=m_g, other=0.0)
            b_acc = tl.load(acc_part + part[:, None] * D + o_v[None, :], mask=m_g[:, None] & m_v[None, :], other=0.0)
            acc += w[:, None] * b_acc
        o = acc / tl.where(m_g, total, 1.0)[:, None]
        rows = tl.cast(i_bh, tl.int64) * G + o_g
        tl.store(out + rows[:, None] * D + o_v[None, :], o.to(out.dtype.element_ty), mask=m_g[:, None] & m_v[None, :])


def _meta(shape: dict) -> dict:
    chunk = min(128, next_pow2(shape["D"]))
    return {"BG": next_pow2(shape["G"]), "BL": BL, "BK": chunk, "BV": chunk}


def _tiles_grid(meta: dict) -> tuple[int]:
    return grid_1d(meta["B"] * meta["HKV"] * meta["NT"])


def _combine_grid(meta: dict) -> tuple[int]:
    return grid_1d(meta["B"] * meta["HKV"] * cdiv(meta["D"], meta["BV"]))


KERNEL_LAUNCHES = {
    "_decode_attention_tiles_kernel": {
        "configs": TILE_CONFIGS,
        "meta": _meta,
        "grid": _tiles_grid,
        "runtime": lambda shape: {"NT": cdiv(shape["L"], BL)},
        "max_shapes": MAX_SHAPES,
    },
    "_decode_attention_combine_kernel": {
        "configs": COMBINE_CONFIGS,
        "meta": _meta,
        "grid": _combine_grid,
        "runtime": lambda shape: {"NT": cdiv(shape["L"], BL)},
        "max_shapes": MAX_SHAPES,
    },
}


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    counts: torch.Tensor,
    scale: float,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """`decode_attention_ref` in two kernels (fp32 softmax and accumulation); raises ValueError as it
    does, and for fp64 inputs or caches whose last dim is not contiguous. slots: [B] int64, the cache row
    each query row reads (several rows may read one; default row b reads row b)."""
    check_decode_attention_inputs(q, k_cache, v_cache, counts, slots)
    if q.dtype == torch.float64:
        raise ValueError("the Triton decode attention computes in fp32: use impl 'torch' for fp64")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache need one layout with a contiguous last dim")
    B, H, D = q.shape
    HKV, L = k_cache.shape[1], k_cache.shape[2]
    # the kernels read one count and slot per row at row * 1: a strided view (a column, an expanded
    # row) would be read past its elements
    counts = counts.contiguous()
    slots = slots if slots is None else slots.contiguous()
    G, NT = H // HKV, cdiv(L, BL)
    out = torch.empty_like(q)
    if B == 0:
        return out
    m_part = torch.empty(B * HKV * NT, G, dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(B * HKV * NT, G, D, dtype=torch.float32, device=q.device)
    meta = _meta({"G": G, "D": D})
    sizes = {"B": B, "HKV": HKV, "NT": NT, "G": G, "D": D}
    launch(
        _decode_attention_tiles_kernel,
        TILE_CONFIGS,
        ["HKV", "G", "D"],
        _tiles_grid,
        q=q.contiguous(),
        k=k_cache,
        v=v_cache,
        counts=counts,
        slots=counts if slots is None else slots,
        m_part=m_part,
        l_part=l_part,
        acc_part=acc_part,
        scale=float(scale),
        stride_ks=k_cache.stride(0),
        stride_kh=k_cache.stride(1),
        stride_kl=k_cache.stride(2),
        DT=dot_dtype(q.dtype),
        DOT_PREC=dot_precision(q.dtype),
        HAS_SLOTS=slots is not None,
        **sizes,
        **meta,
    )
    launch(
        _decode_attention_combine_kernel,
        COMBINE_CONFIGS,
        [],
        _combine_grid,
        m_part=m_part,
        l_part=l_part,
        acc_part=acc_part,
        counts=counts,
        out=out,
        BG=meta["BG"],
        BL=BL,
        BV=meta["BV"],
        **sizes,
    )
    return out


__all__ = ["BL", "KERNEL_LAUNCHES", "decode_attention_triton"]
