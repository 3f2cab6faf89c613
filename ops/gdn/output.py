"""Output stage of the chunked gated delta rule (parallel over chunks), forward and backward.

Per chunk and value head, with h the state entering the chunk and P the causal in-chunk scores:
    P = (Q K^T) * exp(G_i - G_j) for j <= i,      o = scale (exp(G) * (Q h) + P v_new)
Backward: dv_local = scale P^T do (feeds the state backward); then, given the state gradient dh
leaving the chunk and the total dv_new: dq, the output-stage part of dk, dW = -dv_new h^T and
the log-decay gradients (per token and for G_last), one program per chunk and value head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _gdn_chunk_coords, _gdn_decay, _gdn_rstd
from .launch import BT, MAX_SHAPES, ChunkPlan, cdiv, grid_1d, launch, next_pow2

# num_stages=1 candidates: at realistic sizes each program runs its tile loop once, so the default
# 2 stages mostly double-buffer shared memory. Static sm_90 compile (Triton 3.9), 1 stage against 2:
# output dv 32 KB against 91 KB (3 CTAs/SM against 2). Output bwd stays at 1 CTA/SM either way
# (8 warps at >128 registers; its 4-warp builds spill) and its V loops do pipeline, so it gets one
# 1-stage candidate for the search. Its BKB=128 candidates (one K block: ds summed in the block's own
# V loop, each of vn / do / h / dh read once) spill 216 B (2 stages) / 40 B (1 stage) where BKB=64
# does not, but read half the bytes; the GDN bench's search settles on BKB=128, BV=32, 2 stages despite
# the spill (docs/ops.md, gdn).
# Output fwd: one program per (chunk, q/k head) loops over the HV // H value heads and the V blocks, so
# 2 stages do pipeline its h / v_new loads. Static sm_90 compile at Qwen3.5 shapes (bf16, tf32), none
# spills: BV=64 4 warps 233 registers 72 KB (2 CTAs/SM), 1 stage 250 / 16 KB (2); BV=32 234 / 36 KB
# (2); 8 warps BV=128 1 stage 242 / 36 KB and BV=64 234 / 72 KB (1 CTA/SM each). BV=128 at 4 warps
# spills (255 registers + 16-72 B of stack), so it is left out.
OUTPUT_FWD_CONFIGS = [
    {"BV": 64, "num_warps": 4},
    {"BV": 64, "num_warps": 4, "num_stages": 1},
    {"BV": 32, "num_warps": 4},
    {"BV": 128, "num_warps": 8, "num_stages": 1},
    {"BV": 64, "num_warps": 8},
]
OUTPUT_DV_CONFIGS = [
    {"BV": 64, "num_warps": 4},
    {"BV": 64, "num_warps": 8},
    {"BV": 128, "num_warps": 8},
    {"BV": 64, "num_warps": 4, "num_stages": 1},
    {"BV": 128, "num_warps": 4, "num_stages": 1},
]
OUTPUT_BWD_CONFIGS = [
    {"BKB": 64, "BV": 64, "num_warps": 8},
    {"BKB": 64, "BV": 32, "num_warps": 8},
    {"BKB": 64, "BV": 64, "num_warps": 8, "num_stages": 1},
    {"BKB": 128, "BV": 32, "num_warps": 8},
    {"BKB": 128, "BV": 32, "num_warps": 8, "num_stages": 1},
]


@triton.jit(do_not_specialize=["n_chunks"])
def _gdn_output_fwd_kernel(
    q,
    rq,
    k,
    rk,
    gc,
    h,
    vn,
    o,
    cu_seqlens,
    chunk_table,
    n_chunks,
    scale,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
    DT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One program per (chunk, q/k head) tile (1-D grid, looping): o [T, HV, V]. Q K^T is computed
    once and shared by the HV // H value heads of the group (GVA) and all their V blocks."""
    i_p = tl.program_id(0)
    NV: tl.constexpr = (V + BV - 1) // BV
    G: tl.constexpr = HV // H
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    for i_tile in range(i_p, n_chunks * H, tl.num_programs(0)):
        i_c, i_h = i_tile // H, i_tile % H
        t0, n_left = _gdn_chunk_coords(i_c, cu_seqlens, chunk_table, BT)
        m_t = o_t < n_left
        p_qk = (t0 + o_t) * (H * K) + i_h * K
        b_rq = _gdn_rstd(rq, t0, o_t, m_t, i_h, H, L2NORM)
        b_rk = _gdn_rstd(rk, t0, o_t, m_t, i_h, H, L2NORM)
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + p_qk[:, None] + o_k[None, :], mask=m_tk, other=0.0).to(DT)
        b_kt = tl.load(k + p_qk[None, :] + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
        # b_q is passed as a copy (`+ 0.0`): Ascend's tl.dot may overwrite its left operand, and b_q
        # is the left operand again for every value head and V block below.
        b_s = tl.dot(b_q + 0.0, b_kt.to(DT), input_precision=DOT_PREC)
        b_s = b_s * b_rq[:, None] * b_rk[None, :]
        m_causal = (o_t[:, None] >= o_t[None, :]) & m_t[:, None]
        for i_g in range(G):
            i_hv = i_h * G + i_g
            p_tok = (t0 + o_t) * HV + i_hv
            b_g = tl.load(gc + p_tok, mask=m_t, other=0.0)
            b_gq = tl.exp(b_g) * b_rq
            # Scores stay fp32 (TF32 on GPUs for 16-bit inputs): rounding them to bf16 measured
            # rel. RMS 3.7e-3 on o at Qwen3.5 shapes against a 3e-3 budget.
            b_p = b_s * _gdn_decay(b_g, b_g, m_causal)
            for i_v in range(NV):
                o_v = i_v * BV + tl.arange(0, BV)
                m_tv = m_t[:, None] & (o_v < V)[None, :]
                p_h = h + ((t0 * 0 + i_c) * HV + i_hv) * (K * V) + o_k[:, None] * V + o_v[None, :]
                b_h = tl.load(p_h, mask=m_k[:, None] & (o_v < V)[None, :], other=0.0)
                b_o = tl.dot(b_q + 0.0, b_h.to(DT), input_precision=DOT_PREC)
                b_o = b_o * b_gq[:, None]
                b_vn = tl.load(vn + p_tok[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
                b_o += tl.dot(b_p + 0.0, b_vn.to(tl.float32), input_precision=DOT_PREC)
                tl.store(o + p_tok[:, None] * V + o_v[None, :], (b_o * scale).to(o.dtype.element_ty), mask=m_tv)


@triton.jit(do_not_specialize=["n_chunks"])
def _gdn_output_bwd_dv_kernel(
    q,
    rq,
    k,
    rk,
    gc,
    do,
    dvl,
    cu_seqlens,
    chunk_table,
    n_chunks,
    scale,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
    DT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One program per (chunk, value head, V block) tile (1-D grid, looping):
    dv_local = scale P^T do, [T, HV, V] in k's dtype."""
    i_p = tl.program_id(0)
    NV = tl.cdiv(V, BV)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    for i_tile in range(i_p, n_chunks * HV * NV, tl.num_programs(0)):
        i_c, i_hv, i_v = i_tile // (HV * NV), (i_tile // NV) % HV, i_tile % NV
        t0, n_left = _gdn_chunk_coords(i_c, cu_seqlens, chunk_table, BT)
        m_t = o_t < n_left
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_tok = (t0 + o_t) * HV + i_hv
        i_h = i_hv // (HV // H)
        p_qk = (t0 + o_t) * (H * K) + i_h * K
        b_rq = _gdn_rstd(rq, t0, o_t, m_t, i_h, H, L2NORM)
        b_rk = _gdn_rstd(rk, t0, o_t, m_t, i_h, H, L2NORM)
        b_k = tl.load(k + p_qk[:, None] + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_qt = tl.load(q + p_qk[None, :] + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
        b_st = tl.dot(b_k.to(DT), b_qt.to(DT), input_precision=DOT_PREC)  # [key i, query j]
        b_g = tl.load(gc + p_tok, mask=m_t, other=0.0)
        m_causal = (o_t[:, None] <= o_t[None, :]) & m_t[None, :]
        # exp(G_j - G_i) for key i <= query j
        b_st = b_st * _gdn_decay(-b_g, -b_g, m_causal) * (scale * b_rk[:, None] * b_rq[None, :])
        b_do = tl.load(do + p_tok[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
        b_dv = tl.dot(b_st.to(DT), b_do.to(DT), input_precision=DOT_PREC)
        tl.store(dvl + p_tok[:, None] * V + o_v[None, :], b_dv.to(dvl.dtype.element_ty), mask=m_tv)


@triton.jit(do_not_specialize=["n_chunks"])
def _gdn_output_bwd_kernel(
    q,
    rq,
    k,
    rk,
    gc,
    h,
    dh,
    vn,
    dvn,
    do,
    dq,
    dk,
    dw,
    dgam,
    dgl,
    cu_seqlens,
    chunk_table,
    n_chunks,
    scale,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BKB: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
    DT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One program per (chunk, value head) tile (1-D grid, looping), walking its BKB-column K blocks.
    Writes dq and the output-stage dk [T, HV, K], dw [T, HV, K] (all in k's dtype), and the
    log-decay gradients summed over K: dgam [T, HV] (per token) and dgl [NT, HV] (for G_last)."""
    i_p = tl.program_id(0)
    o_t = tl.arange(0, BT)
    for i_tile in range(i_p, n_chunks * HV, tl.num_programs(0)):
        i_c, i_hv = i_tile // HV, i_tile % HV
        t0, n_left = _gdn_chunk_coords(i_c, cu_seqlens, chunk_table, BT)
        m_t = o_t < n_left
        i_h = i_hv // (HV // H)
        # Scalar int64 bases plus small int32 tile offsets (int64 offset tiles cost registers).
        p_tv = (t0 * HV + i_hv) * V
        p_tk = (t0 * HV + i_hv) * K
        p_qk = (t0 * H + i_h) * K
        p_hc = ((t0 * 0 + i_c) * HV + i_hv) * (K * V)
        b_rq = _gdn_rstd(rq, t0, o_t, m_t, i_h, H, L2NORM)
        b_rk = _gdn_rstd(rk, t0, o_t, m_t, i_h, H, L2NORM)
        b_g = tl.load(gc + t0 * HV + i_hv + o_t * HV, mask=m_t, other=0.0)
        b_g_last = tl.load(gc + (t0 + tl.minimum(n_left, BT) - 1) * HV + i_hv)
        m_causal = (o_t[:, None] >= o_t[None, :]) & m_t[:, None]
        # ds = do vn^T is shared by all K blocks. With one K block (BKB >= K) it is summed in that block's
        # V loop from tiles loaded there anyway; with several, one pass over V forms it first, and the
        # decayed dP stays one fp32 [BT, BT] tile. (Forming it inside the first of several K blocks, with
        # that block peeled off the loop, spilled at 8 warps in a static sm_90 compile.)
        b_ds = tl.zeros([BT, BT], dtype=tl.float32)
        if BKB < K:
            for i_v in range(0, tl.cdiv(V, BV)):
                o_v = i_v * BV + tl.arange(0, BV)
                m_v = o_v < V
                b_vnt = tl.load(
                    vn + p_tv + o_t[None, :] * (HV * V) + o_v[:, None], mask=m_v[:, None] & m_t[None, :], other=0.0
                )
                b_do = tl.load(
                    do + p_tv + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0
                )
                b_ds += tl.dot(b_do.to(DT), b_vnt.to(DT), input_precision=DOT_PREC)
            b_dp = b_ds * _gdn_decay(b_g, b_g, m_causal)
        b_dgam = tl.zeros([BT], dtype=tl.float32)
        b_dgl = 0.0  # k.dk3 part of the G_last term
        b_hdh = 0.0  # <dh, h>
        for i_kb in range(0, tl.cdiv(K, BKB)):
            o_k = i_kb * BKB + tl.arange(0, BKB)
            m_k = o_k < K
            m_tk = m_t[:, None] & m_k[None, :]
            m_kt = m_k[:, None] & m_t[None, :]
            o_tk = o_t[:, None] * (HV * K) + o_k[None, :]
            o_qk = o_t[:, None] * (H * K) + o_k[None, :]
            o_qkt = o_t[None, :] * (H * K) + o_k[:, None]
            b_dq = tl.zeros([BT, BKB], dtype=tl.float32)
            b_dk3t = tl.zeros([BKB, BT], dtype=tl.float32)
            b_dw = tl.zeros([BT, BKB], dtype=tl.float32)
            for i_v in range(0, tl.cdiv(V, BV)):
                o_v = i_v * BV + tl.arange(0, BV)
                m_v = o_v < V
                m_tv = m_t[:, None] & m_v[None, :]
                m_kv = m_k[:, None] & m_v[None, :]
                o_tv = o_t[:, None] * (HV * V) + o_v[None, :]
                o_kv = o_k[:, None] * V + o_v[None, :]
                b_vnt = tl.load(
                    vn + p_tv + o_t[None, :] * (HV * V) + o_v[:, None], mask=m_v[:, None] & m_t[None, :], other=0.0
                )
                # h is loaded once, plain: <h, dh> pairs it with dh elementwise, the dots take its transpose.
                b_h = tl.load(h + p_hc + o_kv, mask=m_kv, other=0.0)
                b_ht = tl.trans(b_h)
                b_do = tl.load(do + p_tv + o_tv, mask=m_tv, other=0.0)
                if BKB >= K:
                    # A copy as the left operand: Ascend's tl.dot may overwrite it, and dq reads do next.
                    b_ds += tl.dot(b_do.to(DT) + 0.0, b_vnt.to(DT), input_precision=DOT_PREC)
                b_dq += tl.dot(b_do.to(DT), b_ht.to(DT), input_precision=DOT_PREC)
                b_dh = tl.load(dh + p_hc + o_kv, mask=m_kv, other=0.0)
                b_hdh += tl.sum(tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 1), 0)
                b_dk3t += tl.dot(b_dh.to(DT), b_vnt.to(DT), input_precision=DOT_PREC)
                b_dvn = tl.load(dvn + p_tv + o_tv, mask=m_tv, other=0.0)
                b_dw += tl.dot(b_dvn.to(DT), b_ht.to(DT), input_precision=DOT_PREC)

            tl.store(dw + p_tk + o_tk, (-b_dw).to(dw.dtype.element_ty), mask=m_tk)
            if BKB >= K:
                b_dp = b_ds * _gdn_decay(b_g, b_g, m_causal)
            # Each gradient is stored and reduced into the log-decay terms as soon as it is complete,
            # which keeps few [BT, BKB] fp32 tiles live at once.
            # dP stays fp32 (TF32 on GPUs): dq, dk feed dg = q.dq - k.dk, which cancels.
            b_k = tl.load(k + p_qk + o_qk, mask=m_tk, other=0.0)
            b_dq = (
                b_dq * tl.exp(b_g)[:, None] + tl.dot(b_dp * b_rk[None, :], b_k.to(tl.float32), input_precision=DOT_PREC)
            ) * scale
            tl.store(dq + p_tk + o_tk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
            b_q = tl.load(q + p_qk + o_qk, mask=m_tk, other=0.0).to(tl.float32) * b_rq[:, None]
            b_dgam += tl.sum(b_q * b_dq, 1)
            b_qt = tl.load(q + p_qk + o_qkt, mask=m_kt, other=0.0)
            b_dk3t = b_dk3t * tl.where(m_t, tl.exp(b_g_last - b_g), 0.0)[None, :]
            b_dkt = tl.dot(b_qt.to(tl.float32), b_dp * b_rq[:, None], input_precision=DOT_PREC) * scale + b_dk3t
            tl.store(dk + p_tk + o_t[None, :] * (HV * K) + o_k[:, None], b_dkt.to(dk.dtype.element_ty), mask=m_kt)
            # normalised, transposed
            b_ktf = tl.load(k + p_qk + o_qkt, mask=m_kt, other=0.0).to(tl.float32) * b_rk[None, :]
            b_dgam -= tl.sum(b_ktf * b_dkt, 0)
            b_dgl += tl.sum(tl.sum(b_ktf * b_dk3t, 1), 0)
        tl.store(dgam + t0 * HV + i_hv + o_t * HV, b_dgam, mask=m_t)
        tl.store(dgl + i_c * HV + i_hv, tl.exp(b_g_last) * b_hdh + b_dgl)


def _output_meta(shape: dict) -> dict:
    return {"BT": BT, "BK": next_pow2(shape["K"])}


def _output_bwd_meta(shape: dict) -> dict:
    # The K column block BKB is a config: one program walks all of them and sums their log-decay terms.
    return {"BT": BT}


def _v_grid(meta: dict) -> tuple[int]:
    return grid_1d(meta["n_chunks"] * meta["HV"] * cdiv(meta["V"], meta["BV"]))


def _qk_grid(meta: dict) -> tuple[int]:
    return grid_1d(meta["n_chunks"] * meta["H"])


def _c_grid(meta: dict) -> tuple[int]:
    return grid_1d(meta["n_chunks"] * meta["HV"])


def _max_chunks(shape: dict) -> dict:
    return {"n_chunks": cdiv(shape["T"], BT) + shape["N"]}


KERNEL_LAUNCHES = {
    "_gdn_output_fwd_kernel": {
        "configs": OUTPUT_FWD_CONFIGS,
        "meta": _output_meta,
        "grid": _qk_grid,
        "runtime": _max_chunks,
        "max_shapes": MAX_SHAPES,
    },
    "_gdn_output_bwd_dv_kernel": {
        "configs": OUTPUT_DV_CONFIGS,
        "meta": _output_meta,
        "grid": _v_grid,
        "runtime": _max_chunks,
        "max_shapes": MAX_SHAPES,
    },
    "_gdn_output_bwd_kernel": {
        "configs": OUTPUT_BWD_CONFIGS,
        "meta": _output_bwd_meta,
        "grid": _c_grid,
        "runtime": _max_chunks,
        "max_shapes": MAX_SHAPES,
        "trans": {"b_h": ("BKB", "BV")},
    },
}


def gdn_output_fwd(q, rq, k, rk, gc, h, vn, scale: float, plan: ChunkPlan) -> torch.Tensor:
    """q/k [B, T, H, K], gc [B, T, HV], h [NT, HV, K, V], vn [B, T, HV, V] fp32 -> o [B, T, HV, V] (q dtype)."""
    B, T, H, K = q.shape
    HV, V = vn.shape[2], vn.shape[3]
    o = torch.empty(B, T, HV, V, dtype=q.dtype, device=q.device)
    if plan.NT > 0:
        launch(
            _gdn_output_fwd_kernel,
            OUTPUT_FWD_CONFIGS,
            ["H", "HV", "K", "V"],
            _qk_grid,
            q=q,
            rq=rq,
            k=k,
            rk=rk,
            gc=gc,
            h=h,
            vn=vn,
            o=o,
            scale=scale,
            **plan.tile_args(H, HV, K, V, q.dtype, l2norm=rk is not None),
            **_output_meta({"K": K}),
        )
    return o


def gdn_output_bwd_dv(q, rq, k, rk, gc, do, scale: float, plan: ChunkPlan) -> torch.Tensor:
    """q/k [B, T, H, K], gc [B, T, HV], do [B, T, HV, V] -> dv_local [B, T, HV, V] (k dtype)."""
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    dvl = torch.empty(B, T, HV, V, dtype=k.dtype, device=q.device)
    if plan.NT > 0:
        launch(
            _gdn_output_bwd_dv_kernel,
            OUTPUT_DV_CONFIGS,
            ["H", "HV", "K", "V"],
            _v_grid,
            q=q,
            rq=rq,
            k=k,
            rk=rk,
            gc=gc,
            do=do,
            dvl=dvl,
            scale=scale,
            **plan.tile_args(H, HV, K, V, q.dtype, l2norm=rk is not None),
            **_output_meta({"K": K}),
        )
    return dvl


def gdn_output_bwd(q, rq, k, rk, gc, h, dh, vn, dvn, do, scale: float, plan: ChunkPlan):
    """q/k [B, T, H, K], gc [B, T, HV], h/dh [NT, HV, K, V], vn (fp32)/dvn/do [B, T, HV, V]
    -> dq, dk (output part) [B, T, HV, K] and dw [B, T, HV, K], all in k's dtype,
    dgam [B, T, HV] fp32, dgl [NT, HV] fp32 (the log-decay terms, summed over K)."""
    B, T, H, K = q.shape
    HV, V = vn.shape[2], vn.shape[3]
    meta = _output_bwd_meta({"K": K})
    f32 = dict(dtype=torch.float32, device=q.device)
    # Per value head partials in k's dtype (bf16 for bf16 inputs): they are summed over the GVA group
    # and l2norm-backpropagated in fp32 by `l2norm.gdn_qk_bwd`; the log-decay terms use the fp32 values.
    dq = torch.empty(B, T, HV, K, dtype=k.dtype, device=q.device)
    dk = torch.empty(B, T, HV, K, dtype=k.dtype, device=q.device)
    dw = torch.empty(B, T, HV, K, dtype=k.dtype, device=q.device)
    dgam = torch.empty(B, T, HV, **f32)
    dgl = torch.empty(plan.NT, HV, **f32)
    if plan.NT > 0:
        launch(
            _gdn_output_bwd_kernel,
            OUTPUT_BWD_CONFIGS,
            ["H", "HV", "K", "V"],
            _c_grid,
            q=q,
            rq=rq,
            k=k,
            rk=rk,
            gc=gc,
            h=h,
            dh=dh,
            vn=vn,
            dvn=dvn,
            do=do,
            dq=dq,
            dk=dk,
            dw=dw,
            dgam=dgam,
            dgl=dgl,
            scale=scale,
            **plan.tile_args(H, HV, K, V, q.dtype, l2norm=rk is not None),
            **meta,
        )
    return dq, dk, dw, dgam, dgl
