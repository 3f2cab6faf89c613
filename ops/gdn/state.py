"""The sequential part of the chunked gated delta rule: the state, chunk after chunk.

Forward, per sequence, value head and V block, with h [K, V] the state entering chunk c:
    v_new = u - w h                      (the chunk's values minus what the state predicts)
    h     = exp(G_last) h + (K * exp(G_last - G))^T v_new
Backward, in reverse, with dh the gradient of the state leaving chunk c:
    dv_new = dv_local + (K * exp(G_last - G)) dh
    dh     = exp(G_last) dh + scale (Q * exp(G))^T do - w^T dv_new
State and accumulation in fp32; stored per-chunk states and v_new in the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _gdn_rstd
from .launch import BT, MAX_SHAPES, ChunkPlan, cdiv, dot_dtype, dot_precision, grid_1d, launch, next_pow2

STATE_CONFIGS = [
    {"BV": 32, "num_warps": 4, "num_stages": 2},
    {"BV": 64, "num_warps": 4, "num_stages": 2},
    {"BV": 32, "num_warps": 2, "num_stages": 3},
]


@triton.jit(do_not_specialize=["n_seqs"])
def _gdn_state_fwd_kernel(
    k,
    rk,
    w,
    u,
    gc,
    h0,
    h,
    vn,
    ht,
    cu_seqlens,
    chunk_offsets,
    n_seqs,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_H0: tl.constexpr,
    STORE_FINAL: tl.constexpr,
    L2NORM: tl.constexpr,
    DT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One program per (sequence, value head, V block) tile (1-D grid, looping), walking the
    sequence's chunks in order. Writes h [NT, HV, K, V] (state entering each chunk), vn [T, HV, V],
    and ht [N, HV, K, V] fp32 when STORE_FINAL."""
    i_p = tl.program_id(0)
    NV = tl.cdiv(V, BV)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    for i_tile in range(i_p, n_seqs * HV * NV, tl.num_programs(0)):
        i_n, i_hv, i_v = i_tile // (HV * NV), (i_tile // NV) % HV, i_tile % NV
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T_n = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
        o_v = i_v * BV + tl.arange(0, BV)
        m_kv = m_k[:, None] & (o_v < V)[None, :]
        # int64 through a loaded value: the interpreter's loop index is a Python int.
        p_state = (boh * 0 + i_n * HV + i_hv) * (K * V) + o_k[:, None] * V + o_v[None, :]
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
        if USE_H0:
            b_h += tl.load(h0 + p_state, mask=m_kv, other=0.0).to(tl.float32)
        i_h = i_hv // (HV // H)
        p_k = k + (bos * H + i_h) * K
        for i_t in range(0, tl.cdiv(T_n, BT)):
            n_in = tl.minimum(T_n - i_t * BT, BT)
            m_t = o_t < n_in
            p_tok = (bos + i_t * BT + o_t) * HV + i_hv
            p_h = h + ((boh + i_t) * HV + i_hv) * (K * V) + o_k[:, None] * V + o_v[None, :]
            tl.store(p_h, b_h.to(h.dtype.element_ty), mask=m_kv)
            b_w = tl.load(w + p_tok[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
            m_tv = m_t[:, None] & (o_v < V)[None, :]
            b_vn = tl.load(u + p_tok[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
            b_vn -= tl.dot(b_w.to(DT), b_h.to(DT), input_precision=DOT_PREC)
            tl.store(vn + p_tok[:, None] * V + o_v[None, :], b_vn.to(vn.dtype.element_ty), mask=m_tv)
            b_g = tl.load(gc + p_tok, mask=m_t, other=0.0)
            b_g_last = tl.load(gc + (bos + i_t * BT + n_in - 1) * HV + i_hv)
            p_kt = p_k + (i_t * BT + o_t[None, :]) * (H * K) + o_k[:, None]
            b_kt = tl.load(p_kt, mask=m_k[:, None] & m_t[None, :], other=0.0)
            b_r = _gdn_rstd(rk, bos + i_t * BT, o_t, m_t, i_h, H, L2NORM)
            b_kt = (b_kt * (tl.where(m_t, tl.exp(b_g_last - b_g), 0.0) * b_r)[None, :]).to(DT)
            b_h = b_h * tl.exp(b_g_last) + tl.dot(b_kt, b_vn.to(DT), input_precision=DOT_PREC)
        if STORE_FINAL:
            tl.store(ht + p_state, b_h, mask=m_kv)


@triton.jit(do_not_specialize=["n_seqs"])
def _gdn_state_bwd_kernel(
    q,
    rq,
    k,
    rk,
    w,
    gc,
    dht,
    do,
    dvl,
    dh,
    dh0,
    dvn,
    cu_seqlens,
    chunk_offsets,
    n_seqs,
    scale,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_DHT: tl.constexpr,
    STORE_DH0: tl.constexpr,
    L2NORM: tl.constexpr,
    DT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One program per (sequence, value head, V block) tile (1-D grid, looping), walking the
    chunks in reverse. Writes dh [NT, HV, K, V] (gradient of the state leaving each chunk),
    dvn [T, HV, V] (total gradient of v_new) and dh0 [N, HV, K, V] fp32 when STORE_DH0."""
    i_p = tl.program_id(0)
    NV = tl.cdiv(V, BV)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    for i_tile in range(i_p, n_seqs * HV * NV, tl.num_programs(0)):
        i_n, i_hv, i_v = i_tile // (HV * NV), (i_tile // NV) % HV, i_tile % NV
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T_n = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
        o_v = i_v * BV + tl.arange(0, BV)
        m_kv = m_k[:, None] & (o_v < V)[None, :]
        # int64 through a loaded value: the interpreter's loop index is a Python int.
        p_state = (boh * 0 + i_n * HV + i_hv) * (K * V) + o_k[:, None] * V + o_v[None, :]
        b_dh = tl.zeros([BK, BV], dtype=tl.float32)
        if USE_DHT:
            b_dh += tl.load(dht + p_state, mask=m_kv, other=0.0).to(tl.float32)
        i_h = i_hv // (HV // H)
        p_k = k + (bos * H + i_h) * K
        p_q = q + (bos * H + i_h) * K
        NT_n = tl.cdiv(T_n, BT)
        for i_r in range(0, NT_n):
            i_t = NT_n - 1 - i_r
            n_in = tl.minimum(T_n - i_t * BT, BT)
            m_t = o_t < n_in
            m_tv = m_t[:, None] & (o_v < V)[None, :]
            p_tok = (bos + i_t * BT + o_t) * HV + i_hv
            p_dh = dh + ((boh + i_t) * HV + i_hv) * (K * V) + o_k[:, None] * V + o_v[None, :]
            tl.store(p_dh, b_dh.to(dh.dtype.element_ty), mask=m_kv)
            b_g = tl.load(gc + p_tok, mask=m_t, other=0.0)
            b_g_last = tl.load(gc + (bos + i_t * BT + n_in - 1) * HV + i_hv)
            b_k = tl.load(
                p_k + (i_t * BT + o_t[:, None]) * (H * K) + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0
            )
            b_rk = _gdn_rstd(rk, bos + i_t * BT, o_t, m_t, i_h, H, L2NORM)
            b_k = (b_k * (tl.where(m_t, tl.exp(b_g_last - b_g), 0.0) * b_rk)[:, None]).to(DT)
            b_dvn = tl.load(dvl + p_tok[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
            b_dvn += tl.dot(b_k, b_dh.to(DT), input_precision=DOT_PREC)
            tl.store(dvn + p_tok[:, None] * V + o_v[None, :], b_dvn.to(dvn.dtype.element_ty), mask=m_tv)
            b_qt = tl.load(
                p_q + (i_t * BT + o_t[None, :]) * (H * K) + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0
            )
            b_rq = _gdn_rstd(rq, bos + i_t * BT, o_t, m_t, i_h, H, L2NORM)
            b_qt = (b_qt * (tl.where(m_t, scale * tl.exp(b_g), 0.0) * b_rq)[None, :]).to(DT)
            b_do = tl.load(do + p_tok[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
            b_wt = tl.load(w + p_tok[None, :] * K + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
            b_dh = (
                b_dh * tl.exp(b_g_last)
                + tl.dot(b_qt, b_do.to(DT), input_precision=DOT_PREC)
                - tl.dot(b_wt.to(DT), b_dvn.to(DT), input_precision=DOT_PREC)
            )
        if STORE_DH0:
            tl.store(dh0 + p_state, b_dh, mask=m_kv)


def _state_meta(shape: dict) -> dict:
    return {"BT": BT, "BK": next_pow2(shape["K"])}


def _state_grid(meta: dict) -> tuple[int]:
    return grid_1d(meta["n_seqs"] * meta["HV"] * cdiv(meta["V"], meta["BV"]))


def _max_seqs(shape: dict) -> dict:
    return {"n_seqs": shape["N"]}


KERNEL_LAUNCHES = {
    "_gdn_state_fwd_kernel": {
        "configs": STATE_CONFIGS,
        "meta": _state_meta,
        "grid": _state_grid,
        "runtime": _max_seqs,
        "max_shapes": MAX_SHAPES,
    },
    "_gdn_state_bwd_kernel": {
        "configs": STATE_CONFIGS,
        "meta": _state_meta,
        "grid": _state_grid,
        "runtime": _max_seqs,
        "max_shapes": MAX_SHAPES,
    },
}


def gdn_state_fwd(k, rk, w, u, gc, h0, output_final_state: bool, plan: ChunkPlan):
    """k [B, T, H, K], w [B, T, HV, K], u [B, T, HV, V], gc [B, T, HV], h0 [N, HV, K, V] or None
    -> h [NT, HV, K, V] (k dtype), vn [B, T, HV, V] (k dtype), ht [N, HV, K, V] fp32 or None."""
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    h = torch.empty(plan.NT, HV, K, V, dtype=k.dtype, device=k.device)
    vn = torch.empty_like(u)
    ht = torch.empty(plan.N, HV, K, V, dtype=torch.float32, device=k.device) if output_final_state else None
    launch(
        _gdn_state_fwd_kernel,
        STATE_CONFIGS,
        ["H", "HV", "K", "V"],
        _state_grid,
        k=k,
        rk=rk,
        w=w,
        u=u,
        gc=gc,
        h0=h0,
        h=h,
        vn=vn,
        ht=ht,
        cu_seqlens=plan.cu_seqlens,
        chunk_offsets=plan.chunk_offsets,
        n_seqs=plan.N,
        H=H,
        HV=HV,
        K=K,
        V=V,
        USE_H0=h0 is not None,
        STORE_FINAL=output_final_state,
        L2NORM=rk is not None,
        DT=dot_dtype(k.dtype),
        DOT_PREC=dot_precision(k.dtype),
        **_state_meta({"K": K}),
    )
    return h, vn, ht


def gdn_state_bwd(q, rq, k, rk, w, gc, dht, do, dvl, scale: float, need_dh0: bool, plan: ChunkPlan):
    """q/k [B, T, H, K], w [B, T, HV, K], gc [B, T, HV], dht [N, HV, K, V] or None, do/dvl [B, T, HV, V]
    -> dh [NT, HV, K, V] (k dtype), dh0 [N, HV, K, V] fp32 or None, dvn [B, T, HV, V] (k dtype)."""
    B, T, H, K = k.shape
    HV, V = do.shape[2], do.shape[3]
    dh = torch.empty(plan.NT, HV, K, V, dtype=k.dtype, device=k.device)
    dh0 = torch.empty(plan.N, HV, K, V, dtype=torch.float32, device=k.device) if need_dh0 else None
    dvn = torch.empty(B, T, HV, V, dtype=k.dtype, device=k.device)
    launch(
        _gdn_state_bwd_kernel,
        STATE_CONFIGS,
        ["H", "HV", "K", "V"],
        _state_grid,
        q=q,
        rq=rq,
        k=k,
        rk=rk,
        w=w,
        gc=gc,
        dht=dht,
        do=do,
        dvl=dvl,
        dh=dh,
        dh0=dh0,
        dvn=dvn,
        cu_seqlens=plan.cu_seqlens,
        chunk_offsets=plan.chunk_offsets,
        n_seqs=plan.N,
        scale=scale,
        H=H,
        HV=HV,
        K=K,
        V=V,
        USE_DHT=dht is not None,
        STORE_DH0=need_dh0,
        L2NORM=rk is not None,
        DT=dot_dtype(k.dtype),
        DOT_PREC=dot_precision(k.dtype),
        **_state_meta({"K": K}),
    )
    return dh, dh0, dvn
