"""The sequential part of the chunked gated delta rule: the state, chunk after chunk.

Forward, per sequence, value head and V block, with h [K, V] the state entering chunk c and
Ai, w from `solve.py` and `wy.py`:
    v_new = Ai diag(beta) v - w h        (the chunk's values u = Ai diag(beta) v minus what the state predicts)
    h     = exp(G_last) h + (K * exp(G_last - G))^T v_new
Backward, in reverse, with dh the gradient of the state leaving chunk c:
    dv_new = dv_local + (K * exp(G_last - G)) dh
    dh     = exp(G_last) dh + scale (Q * exp(G))^T do - w^T dv_new
State and accumulation in fp32; stored per-chunk states in the input dtype. u and v_new stay fp32: a
16-bit u, and a 16-bit v_new, were the two largest roundings in the bf16 output error after the
output's own (measured with fp64 emulation at Qwen3.5 shapes). u is formed here from two loaded 16-bit
tiles (Ai diag(beta) from `wy.py`, and v), which go to the tensor cores without passing through
registers: an fp32 u formed by another kernel costs its 4-byte write and read, and a u formed here from
fp32 operands computed in registers more than doubled this sequential pass (docs/ops.md, gdn).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _gdn_rstd
from .launch import BT, MAX_SHAPES, ChunkPlan, cdiv, dot_dtype, dot_precision, grid_1d, launch, next_pow2

# The state kernels run one program per (sequence, value head, V block): at B=1, HV=32, BV=16 gives
# about two programs per multiprocessor of a 132-SM GPU, BV=32 one. Static sm_90 compile (Triton 3.9,
# Qwen3.5 shapes), forward: none spills; 4 warps BV=16/32/64 take 132/168/244 registers (BV=32 at 3
# stages 190), 8 warps BV=32/64 155/211. The autotuner chooses per device; at Qwen3.5 shapes the GDN
# bench's search settles on BV=32, 4 warps, 3 stages for both directions (docs/ops.md, gdn).
STATE_CONFIGS = [
    {"BV": 32, "num_warps": 4, "num_stages": 2},
    {"BV": 16, "num_warps": 4, "num_stages": 2},
    {"BV": 32, "num_warps": 4, "num_stages": 3},
    {"BV": 64, "num_warps": 4, "num_stages": 2},
    {"BV": 32, "num_warps": 8, "num_stages": 2},
    {"BV": 64, "num_warps": 8, "num_stages": 2},
]


@triton.jit(do_not_specialize=["n_seqs"])
def _gdn_state_fwd_kernel(
    k,
    rk,
    v,
    w,
    AiB,
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
    sequence's chunks in order. Writes h [NT, HV, K, V] (state entering each chunk), vn [T, HV, V]
    (v_new) and ht [N, HV, K, V] fp32 when STORE_FINAL."""
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
        m_v = o_v < V
        m_kv = m_k[:, None] & m_v[None, :]
        # Scalar int64 bases plus small int32 tile offsets: int64 offset tiles cost registers.
        # The int64 comes through a loaded value: the interpreter's loop index is a Python int.
        o_kv = o_k[:, None] * V + o_v[None, :]
        p_s = (boh * 0 + i_n * HV + i_hv) * (K * V)
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
        if USE_H0:
            b_h += tl.load(h0 + p_s + o_kv, mask=m_kv, other=0.0).to(tl.float32)
        i_h = i_hv // (HV // H)
        for i_t in range(0, tl.cdiv(T_n, BT)):
            t_c = bos + i_t * BT
            n_in = tl.minimum(T_n - i_t * BT, BT)
            m_t = o_t < n_in
            m_tv = m_t[:, None] & m_v[None, :]
            tl.store(h + ((boh + i_t) * HV + i_hv) * (K * V) + o_kv, b_h.to(h.dtype.element_ty), mask=m_kv)
            p_w = w + (t_c * HV + i_hv) * K
            b_w = tl.load(p_w + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
            o_tv = o_t[:, None] * (HV * V) + o_v[None, :]
            p_tv = (t_c * HV + i_hv) * V
            # u = (Ai diag(beta)) v from two loaded 16-bit tiles, fp32 accumulation: one 16-bit rounding
            # (of Ai diag(beta), where Ai alone was rounded before) and no fp32 u round trip through memory.
            b_aib = tl.load(
                AiB + (t_c * HV + i_hv) * BT + o_t[:, None] * (HV * BT) + o_t[None, :], mask=m_t[:, None], other=0.0
            )
            b_v = tl.load(v + p_tv + o_tv, mask=m_tv, other=0.0)
            b_vn = tl.dot(b_aib.to(DT), b_v.to(DT), input_precision=DOT_PREC)
            b_vn -= tl.dot(b_w.to(DT), b_h.to(DT), input_precision=DOT_PREC)
            tl.store(vn + p_tv + o_tv, b_vn.to(vn.dtype.element_ty), mask=m_tv)
            b_g = tl.load(gc + t_c * HV + i_hv + o_t * HV, mask=m_t, other=0.0)
            b_g_last = tl.load(gc + (t_c + n_in - 1) * HV + i_hv)
            # The key scaling exp(G_last - G) / |k| goes on the [BT, BV] v_new rows, not on K^T.
            b_r = _gdn_rstd(rk, t_c, o_t, m_t, i_h, H, L2NORM)
            b_vn = b_vn * (tl.where(m_t, tl.exp(b_g_last - b_g), 0.0) * b_r)[:, None]
            b_kt = tl.load(
                k + (t_c * H + i_h) * K + o_t[None, :] * (H * K) + o_k[:, None],
                mask=m_k[:, None] & m_t[None, :],
                other=0.0,
            )
            b_h = b_h * tl.exp(b_g_last)
            b_h = tl.dot(b_kt.to(DT), b_vn.to(DT), b_h, input_precision=DOT_PREC)
        if STORE_FINAL:
            tl.store(ht + p_s + o_kv, b_h, mask=m_kv)


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
        m_v = o_v < V
        m_kv = m_k[:, None] & m_v[None, :]
        o_kv = o_k[:, None] * V + o_v[None, :]
        p_s = (boh * 0 + i_n * HV + i_hv) * (K * V)
        b_dh = tl.zeros([BK, BV], dtype=tl.float32)
        if USE_DHT:
            b_dh += tl.load(dht + p_s + o_kv, mask=m_kv, other=0.0).to(tl.float32)
        i_h = i_hv // (HV // H)
        NT_n = tl.cdiv(T_n, BT)
        for i_r in range(0, NT_n):
            i_t = NT_n - 1 - i_r
            t_c = bos + i_t * BT
            n_in = tl.minimum(T_n - i_t * BT, BT)
            m_t = o_t < n_in
            m_tv = m_t[:, None] & m_v[None, :]
            m_kt = m_k[:, None] & m_t[None, :]
            tl.store(dh + ((boh + i_t) * HV + i_hv) * (K * V) + o_kv, b_dh.to(dh.dtype.element_ty), mask=m_kv)
            b_g = tl.load(gc + t_c * HV + i_hv + o_t * HV, mask=m_t, other=0.0)
            b_g_last = tl.load(gc + (t_c + n_in - 1) * HV + i_hv)
            # Row scalings go on the [BT, BV] results and cotangents, not on the [BT, BK] q/k tiles.
            b_sk = tl.where(m_t, tl.exp(b_g_last - b_g), 0.0) * _gdn_rstd(rk, t_c, o_t, m_t, i_h, H, L2NORM)
            b_sq = tl.where(m_t, scale * tl.exp(b_g), 0.0) * _gdn_rstd(rq, t_c, o_t, m_t, i_h, H, L2NORM)
            p_qk = (t_c * H + i_h) * K
            b_k = tl.load(k + p_qk + o_t[:, None] * (H * K) + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
            o_tv = o_t[:, None] * (HV * V) + o_v[None, :]
            p_tv = (t_c * HV + i_hv) * V
            b_dvn = tl.dot(b_k.to(DT), b_dh.to(DT), input_precision=DOT_PREC) * b_sk[:, None]
            b_dvn += tl.load(dvl + p_tv + o_tv, mask=m_tv, other=0.0).to(tl.float32)
            b_dvn = b_dvn.to(dvn.dtype.element_ty)
            tl.store(dvn + p_tv + o_tv, b_dvn, mask=m_tv)
            b_do = tl.load(do + p_tv + o_tv, mask=m_tv, other=0.0).to(tl.float32) * b_sq[:, None]
            b_qt = tl.load(q + p_qk + o_t[None, :] * (H * K) + o_k[:, None], mask=m_kt, other=0.0)
            b_wt = tl.load(w + (t_c * HV + i_hv) * K + o_t[None, :] * (HV * K) + o_k[:, None], mask=m_kt, other=0.0)
            b_dh = b_dh * tl.exp(b_g_last)
            b_dh = tl.dot(b_qt.to(DT), b_do.to(DT), b_dh, input_precision=DOT_PREC)
            b_dh = tl.dot(b_wt.to(DT), -b_dvn.to(DT), b_dh, input_precision=DOT_PREC)
        if STORE_DH0:
            tl.store(dh0 + p_s + o_kv, b_dh, mask=m_kv)


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


def gdn_state_fwd(k, rk, v, w, AiB, gc, h0, output_final_state: bool, plan: ChunkPlan):
    """k [B, T, H, K], v [B, T, HV, V], w [B, T, HV, K], AiB [B, T, HV, BT] (Ai diag(beta)), gc [B, T, HV],
    h0 [N, HV, K, V] or None -> h [NT, HV, K, V] (k dtype), vn [B, T, HV, V] fp32, ht [N, HV, K, V] fp32 or None."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    h = torch.empty(plan.NT, HV, K, V, dtype=k.dtype, device=k.device)
    vn = torch.empty(B, T, HV, V, dtype=torch.float32, device=k.device)
    ht = torch.empty(plan.N, HV, K, V, dtype=torch.float32, device=k.device) if output_final_state else None
    launch(
        _gdn_state_fwd_kernel,
        STATE_CONFIGS,
        ["H", "HV", "K", "V"],
        _state_grid,
        k=k,
        rk=rk,
        v=v,
        w=w,
        AiB=AiB,
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
