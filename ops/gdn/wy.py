"""WY representation of the chunked gated delta rule, forward and backward.

Forward, per chunk and value head (Ai = (I + A)^-1 from `solve.py`):
    W = Ai diag(beta exp(G)) K   [BT, K]      AiB = Ai diag(beta) [BT, BT], from which the state stage forms U = AiB V
Backward, given dW and dU (= dv_new) from the state/output stages, through W, U and
A = diag(beta) (K K^T * exp(G_i - G_j)) (strictly lower) to dk, dv, dbeta and the log-decay,
then the reverse in-chunk cumsum to dg and, for the in-kernel gate, to da / dA_log.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _gdn_chunk_coords, _gdn_decay, _gdn_load_ai, _gdn_rstd
from .launch import BT, MAX_SHAPES, ChunkPlan, cdiv, grid_1d, launch, next_pow2

# WY fwd (w and Ai diag(beta)): the autotuner chooses per device; at Qwen3.5 shapes the GDN bench's search
# settles on 4 warps with 1 stage (docs/ops.md, gdn). Static sm_90 compile: 75 / 154 registers at 8 / 4
# warps, no spills.
W_CONFIGS = [{"num_warps": 8}, {"num_warps": 4}, {"num_warps": 4, "num_stages": 1}]
# WY bwd: BV=64 at 8 warps does not spill (sm_90, Triton 3.9); the others do (4 warps: ~290 B) and are
# left to the autotuner, as register allocation differs between Triton versions.
WY_BWD_CONFIGS = [{"BV": 64, "num_warps": 8}, {"BV": 32, "num_warps": 8}, {"BV": 64, "num_warps": 4}]


@triton.jit(do_not_specialize=["n_chunks"])
def _gdn_wy_fwd_kernel(
    k,
    rk,
    beta,
    gc,
    Ai,
    w,
    AiB,
    cu_seqlens,
    chunk_table,
    n_chunks,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    STORE_AIB: tl.constexpr,
    L2NORM: tl.constexpr,
    DT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One program per (chunk, value head) tile (1-D grid, looping): w = Ai (beta exp(G) k), written
    in k's dtype, and when STORE_AIB also AiB = Ai diag(beta) [T, HV, BT] (whole rows, zeros above the
    diagonal), from which the state stage forms u = AiB v."""
    i_p = tl.program_id(0)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    for i_tile in range(i_p, n_chunks * HV, tl.num_programs(0)):
        i_c, i_hv = i_tile // HV, i_tile % HV
        t0, n_left = _gdn_chunk_coords(i_c, cu_seqlens, chunk_table, BT)
        m_t = o_t < n_left
        # Scalar int64 bases plus small int32 tile offsets (int64 offset tiles cost registers).
        p_t1 = t0 * HV + i_hv
        b_beta = tl.load(beta + p_t1 + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
        b_g = tl.load(gc + p_t1 + o_t * HV, mask=m_t, other=0.0)
        i_h = i_hv // (HV // H)
        b_r = _gdn_rstd(rk, t0, o_t, m_t, i_h, H, L2NORM)
        m_tk = m_t[:, None] & m_k[None, :]
        b_k = tl.load(k + (t0 * H + i_h) * K + o_t[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.0)
        b_kb = (b_k * (b_beta * tl.exp(b_g) * b_r)[:, None]).to(DT)
        b_ai = _gdn_load_ai(Ai + p_t1 * BT, o_t, m_t, False, HV * BT)
        if STORE_AIB:
            b_aib = b_ai.to(tl.float32) * b_beta[None, :]  # column j scaled by beta_j
            p_aib = AiB + p_t1 * BT + o_t[:, None] * (HV * BT) + o_t[None, :]
            tl.store(p_aib, b_aib.to(AiB.dtype.element_ty), mask=m_t[:, None])
        b_w = tl.dot(b_ai.to(DT), b_kb, input_precision=DOT_PREC)
        tl.store(w + p_t1 * K + o_t[:, None] * (HV * K) + o_k[None, :], b_w.to(w.dtype.element_ty), mask=m_tk)


@triton.jit(do_not_specialize=["n_chunks"])
def _gdn_wy_bwd_kernel(
    k,
    rk,
    v,
    beta,
    gc,
    Ai,
    dw,
    dvn,
    dgam,
    dgl,
    a,
    A_log,
    dt_bias,
    dk,
    dv,
    dbeta,
    dg,
    dA_log_tok,
    cu_seqlens,
    chunk_table,
    n_chunks,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BKC: tl.constexpr,
    BV: tl.constexpr,
    GATE_IN_KERNEL: tl.constexpr,
    L2NORM: tl.constexpr,
    DT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One program per (chunk, value head) tile (1-D grid, looping). From dW [T, HV, K] and
    dU = dv_new [T, HV, V]: dk (the WY part, added in place to the output stage's dk per value head), dv, dbeta, and the log-decay
    gradient: dgam [T, HV] and dgl [NT, HV] (the output stage's terms) plus this
    stage's terms, reverse-cumsummed in the chunk -> dg (or da and dA_log per token).
    Ai is read once per tile, and few fp32 [BT, BT] tiles are live at a time (K K^T is never held
    whole: each K block's part is reduced against dA as it is formed) to keep spills off."""
    i_p = tl.program_id(0)
    o_t = tl.arange(0, BT)
    m_lo = o_t[:, None] > o_t[None, :]
    for i_tile in range(i_p, n_chunks * HV, tl.num_programs(0)):
        i_c, i_hv = i_tile // HV, i_tile % HV
        t0, n_left = _gdn_chunk_coords(i_c, cu_seqlens, chunk_table, BT)
        m_t = o_t < n_left
        p_tok = (t0 + o_t) * HV + i_hv
        # Scalar int64 bases plus small int32 tile offsets (int64 offset tiles cost registers).
        p_t1 = t0 * HV + i_hv
        b_beta = tl.load(beta + p_t1 + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
        b_g = tl.load(gc + p_t1 + o_t * HV, mask=m_t, other=0.0)
        b_eg = tl.where(m_t, tl.exp(b_g), 0.0)
        i_h = i_hv // (HV // H)
        p_k = k + (t0 * H + i_h) * K
        b_r = _gdn_rstd(rk, t0, o_t, m_t, i_h, H, L2NORM)
        b_s = b_beta * b_eg * b_r  # W's row scale on the raw keys
        # Ai^T once, in DT (exact: Ai is stored in the input dtype), for every product. As a left
        # tl.dot operand it is passed as a copy (`+ 0.0`): Ascend's tl.dot may overwrite its left operand.
        b_ait = _gdn_load_ai(Ai + p_t1 * BT, o_t, m_t, True, HV * BT).to(DT)

        # dU -> dv, dbeta; dT = dU (beta V)^T accumulated over V blocks.
        b_dT = tl.zeros([BT, BT], dtype=tl.float32)
        b_dbeta = tl.zeros([BT], dtype=tl.float32)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_tv = m_t[:, None] & (o_v < V)[None, :]
            o_tv = o_t[:, None] * (HV * V) + o_v[None, :]
            b_dvn = tl.load(dvn + p_t1 * V + o_tv, mask=m_tv, other=0.0).to(DT)
            b_dvb = tl.dot(b_ait + 0.0, b_dvn, input_precision=DOT_PREC)
            tl.store(dv + p_t1 * V + o_tv, (b_dvb * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_tv)
            b_v = tl.load(v + p_t1 * V + o_tv, mask=m_tv, other=0.0)
            b_dbeta += tl.sum(b_v.to(tl.float32) * b_dvb, 1)
            # (beta V)^T by a register transpose (declared in KERNEL_LAUNCHES), not a second strided load.
            b_vb = (b_v * b_beta[:, None]).to(DT)
            b_dT = tl.dot(b_dvn, tl.trans(b_vb), b_dT, input_precision=DOT_PREC)

        # dT += dW (beta exp(G) K)^T per K block: no dW K^T [BT, BT] tile outlives its block.
        for i_k in range(0, tl.cdiv(K, BKC)):
            o_k = i_k * BKC + tl.arange(0, BKC)
            m_k = o_k < K
            b_kt = tl.load(p_k + o_t[None, :] * (H * K) + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
            b_dT += (
                tl.dot(
                    tl.load(
                        dw + p_t1 * K + o_t[:, None] * (HV * K) + o_k[None, :],
                        mask=m_t[:, None] & m_k[None, :],
                        other=0.0,
                    ).to(DT),
                    b_kt.to(DT),
                    input_precision=DOT_PREC,
                )
                * b_s[None, :]
            )

        # dA = -(Ai^T dT Ai^T), strictly lower, valid rows only.
        b_x = tl.dot(b_ait.to(tl.float32) + 0.0, b_dT, input_precision=DOT_PREC)
        b_dA = -tl.dot(b_x, b_ait.to(tl.float32), input_precision=DOT_PREC)
        b_dA = b_dA * _gdn_decay(b_g, b_g, m_lo & m_t[:, None] & m_t[None, :])  # dA_ij exp(G_i - G_j)
        b_y = b_dA * b_beta[:, None]
        # Y + Y^T through one [BT, BT] fp32 transpose (16 KiB, declared in KERNEL_LAUNCHES): a second
        # dA^T = -(Ai dT^T Ai) chain would double this kernel's tl.dot work.
        b_y = b_y + tl.trans(b_y)

        # Z = dA * (l2-normalised) K K^T, one K block at a time: only its row sums and beta-weighted
        # column sums are needed, so no K K^T tile is kept and dA is dead before the dk pass.
        b_dA = b_dA * b_r[:, None] * b_r[None, :]
        b_zr = tl.zeros([BT], dtype=tl.float32)
        b_zc = tl.zeros([BT], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BKC)):
            o_k = i_k * BKC + tl.arange(0, BKC)
            b_kr = tl.load(
                p_k + o_t[:, None] * (H * K) + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :], other=0.0
            )
            b_z = b_dA * tl.dot(b_kr.to(DT), tl.trans(b_kr).to(DT), input_precision=DOT_PREC)
            b_zr += tl.sum(b_z, 1)
            b_zc += tl.sum(b_z * b_beta[:, None], 0)

        # dk = diag(beta exp(G)) P + (Y + Y^T) K with P = Ai^T dW, one BKC-wide column block at a time;
        # k_i . P_i is the W part of dbeta and of the log-decay.
        b_kdkb = tl.zeros([BT], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BKC)):
            o_k = i_k * BKC + tl.arange(0, BKC)
            m_tk = m_t[:, None] & (o_k < K)[None, :]
            b_kr = tl.load(p_k + o_t[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
            b_p = tl.dot(
                b_ait + 0.0,
                tl.load(dw + p_t1 * K + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_tk, other=0.0).to(DT),
                input_precision=DOT_PREC,
            )
            b_kdkb += tl.sum(b_p * b_kr, 1)
            b_dk = tl.dot(b_y * b_r[None, :], b_kr, b_p * (b_beta * b_eg)[:, None], input_precision=DOT_PREC)
            # dk holds the output stage's part of this (token, value head) row: add it in place.
            p_dk = dk + p_t1 * K + o_t[:, None] * (HV * K) + o_k[None, :]
            b_dk += tl.load(p_dk, mask=m_tk, other=0.0).to(tl.float32)
            tl.store(p_dk, b_dk.to(dk.dtype.element_ty), mask=m_tk)
        b_kdkb = b_kdkb * b_r
        b_dbeta += b_zr + b_eg * b_kdkb
        b_dgam = b_beta * b_zr - b_zc + b_beta * b_eg * b_kdkb  # row sums minus column sums of dA * A
        tl.store(dbeta + p_t1 + o_t * HV, b_dbeta.to(dbeta.dtype.element_ty), mask=m_t)

        # Log-decay: the output stage's partials, then dg_i = sum_{j >= i} dG_j + dG_last.
        b_dgam += tl.load(dgam + p_tok, mask=m_t, other=0.0)
        b_dgl = tl.load(dgl + i_c * HV + i_hv)
        b_dg = tl.sum(tl.where(o_t[None, :] >= o_t[:, None], b_dgam[None, :], 0.0), 1) + b_dgl
        if GATE_IN_KERNEL:
            b_x = tl.load(a + p_tok, mask=m_t, other=0.0).to(tl.float32) + tl.load(dt_bias + i_hv).to(tl.float32)
            b_A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
            b_sig = 1.0 / (1.0 + tl.exp(-b_x))
            b_y1 = tl.exp(tl.minimum(b_x, 20.0))
            b_u1 = 1.0 + b_y1
            b_sp = tl.where(b_u1 == 1.0, b_y1, tl.log(b_u1) * b_y1 / (b_u1 - 1.0))
            b_sp = tl.where(b_x > 20.0, b_x, b_sp)
            tl.store(dg + p_tok, (-b_A * b_sig * b_dg).to(dg.dtype.element_ty), mask=m_t)
            tl.store(dA_log_tok + p_tok, -b_A * b_sp * b_dg, mask=m_t)
        else:
            tl.store(dg + p_tok, b_dg.to(dg.dtype.element_ty), mask=m_t)


def _wy_meta(shape: dict) -> dict:
    return {"BT": BT, "BK": next_pow2(shape["K"])}


def _wy_bwd_meta(shape: dict) -> dict:
    # BKC: the K column block of the backward (two [BT, 64] tiles live rather than [BT, 128] ones)
    return {"BT": BT, "BKC": min(64, next_pow2(shape["K"]))}


def _wy_grid(meta: dict) -> tuple[int]:
    return grid_1d(meta["n_chunks"] * meta["HV"])


def _wy_max_tiles(shape: dict) -> dict:
    return {"n_chunks": cdiv(shape["T"], BT) + shape["N"]}


KERNEL_LAUNCHES = {
    "_gdn_wy_fwd_kernel": {
        "configs": W_CONFIGS,
        "meta": _wy_meta,
        "grid": _wy_grid,
        "runtime": _wy_max_tiles,
        "max_shapes": MAX_SHAPES,
    },
    "_gdn_wy_bwd_kernel": {
        "trans": {"b_vb": ("BT", "BV"), "b_y": ("BT", "BT"), "b_kr": ("BT", "BKC")},
        "configs": WY_BWD_CONFIGS,
        "meta": _wy_bwd_meta,
        "grid": _wy_grid,
        "runtime": _wy_max_tiles,
        "max_shapes": MAX_SHAPES,
    },
}


def gdn_wy_fwd(k, rk, beta, gc, Ai, plan: ChunkPlan, store_aib: bool):
    """k [B, T, H, K], beta/gc [B, T, HV], Ai [B, T, HV, BT] -> w [B, T, HV, K] and, when store_aib,
    AiB = Ai diag(beta) [B, T, HV, BT] (else None: the backward needs w alone), both in k's dtype."""
    B, T, H, K = k.shape
    HV = beta.shape[2]
    w = torch.empty(B, T, HV, K, dtype=k.dtype, device=k.device)
    AiB = torch.empty_like(Ai) if store_aib else None
    if plan.NT > 0:
        launch(
            _gdn_wy_fwd_kernel,
            W_CONFIGS,
            ["H", "HV", "K"],
            _wy_grid,
            k=k,
            rk=rk,
            beta=beta,
            gc=gc,
            Ai=Ai,
            w=w,
            AiB=AiB,
            STORE_AIB=store_aib,
            **plan.tile_args(H, HV, K, None, k.dtype, l2norm=rk is not None),
            **_wy_meta({"K": K}),
        )
    return w, AiB


def gdn_wy_bwd(k, rk, v, beta, gc, Ai, dw, dvn, dk, dgam, dgl, gate, g_dtype, plan: ChunkPlan):
    """Backward of the WY stage and of the gate.
    k [B, T, H, K], v [B, T, HV, V], beta/gc [B, T, HV], Ai [B, T, HV, BT], dw [B, T, HV, K],
    dvn [B, T, HV, V], dgam [B, T, HV] fp32, dgl [NT, HV] fp32, gate (a, A_log, dt_bias) or None
    dk [B, T, HV, K] (k dtype; the output stage's part, to which the WY part is added in place)
    -> dk, dv (v dtype), dbeta (beta dtype),
    dg [B, T, HV] (g_dtype; da for the in-kernel gate), dA_log_tok [B, T, HV] fp32 or None."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    dv = torch.empty_like(v)
    dbeta = torch.empty_like(beta)
    dg = torch.empty(B, T, HV, dtype=g_dtype, device=k.device)
    a, A_log, dt_bias = gate if gate is not None else (None, None, None)
    dA_log_tok = torch.empty(B, T, HV, dtype=torch.float32, device=k.device) if gate is not None else None
    meta = _wy_bwd_meta({"K": K})
    if plan.NT > 0:
        launch(
            _gdn_wy_bwd_kernel,
            WY_BWD_CONFIGS,
            ["H", "HV", "K", "V"],
            _wy_grid,
            restore=("dk",),
            k=k,
            rk=rk,
            v=v,
            beta=beta,
            gc=gc,
            Ai=Ai,
            dw=dw,
            dvn=dvn,
            dgam=dgam,
            dgl=dgl,
            a=a,
            A_log=A_log,
            dt_bias=dt_bias,
            dk=dk,
            dv=dv,
            dbeta=dbeta,
            dg=dg,
            dA_log_tok=dA_log_tok,
            GATE_IN_KERNEL=gate is not None,
            **plan.tile_args(H, HV, K, V, k.dtype, l2norm=rk is not None),
            **meta,
        )
    return dk, dv, dbeta, dg, dA_log_tok
