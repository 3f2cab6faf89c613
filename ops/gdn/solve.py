"""Stage 1 of the chunked gated delta rule: gate, in-chunk cumsum, and the WY inverse.

Per 64-token chunk and value head: G = cumsum(g) within the chunk (fp32), then
A = diag(beta) (K K^T * exp(G_i - G_j)) strictly below the diagonal, and Ai = (I + A)^-1,
a unit lower-triangular [64, 64] matrix. Optionally the gate itself is computed in-kernel:
g = -exp(A_log) * softplus(a + dt_bias), so the model never materialises g.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _gdn_decay, _gdn_rstd
from .launch import BC, BT, MAX_SHAPES, ChunkPlan, cdiv, dot_dtype, dot_precision, grid_1d, launch, next_pow2

SOLVE_CONFIGS = [{"num_warps": 4}, {"num_warps": 8}, {"num_warps": 2}]


@triton.jit
def _gdn_gate(g, a, A_log, dt_bias, p_off, m, i_hv, GATE_IN_KERNEL: tl.constexpr):
    """Log-decay of the tokens at offsets `p_off` ([BC], masked by m) for value head i_hv, fp32."""
    if GATE_IN_KERNEL:
        b_x = tl.load(a + p_off, mask=m, other=0.0).to(tl.float32) + tl.load(dt_bias + i_hv).to(tl.float32)
        # softplus with log1p accuracy for very negative x (Kahan: log(u) * y / (u - 1), u = 1 + y).
        b_y = tl.exp(tl.minimum(b_x, 20.0))
        b_u = 1.0 + b_y
        b_sp = tl.where(b_u == 1.0, b_y, tl.log(b_u) * b_y / (b_u - 1.0))
        b_sp = tl.where(b_x > 20.0, b_x, b_sp)
        b_g = -tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * b_sp
        return tl.where(m, b_g, 0.0)
    else:
        return tl.load(g + p_off, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _gdn_a_block(
    p_k,
    o_r,
    m_r,
    o_s,
    m_s,
    o_k,
    m_k,
    b_beta_r,
    b_g_r,
    b_g_s,
    b_r_r,
    b_r_s,
    DIAG: tl.constexpr,
    STRIDE: tl.constexpr,
    DT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Block (r, s) of A = beta_r * exp(G_r - G_s) * (r_r k_r) . (r_s k_s) for two 16-row blocks of
    one chunk ([BC, BC] fp32), zero outside the strictly-lower valid part. Both key tiles are
    loaded fresh (Ascend's tl.dot may overwrite its left operand)."""
    b_kr = tl.load(p_k + o_r[:, None] * STRIDE + o_k[None, :], mask=m_r[:, None] & m_k[None, :], other=0.0)
    b_kst = tl.load(p_k + o_s[None, :] * STRIDE + o_k[:, None], mask=m_k[:, None] & m_s[None, :], other=0.0)
    b_kk = tl.dot(b_kr.to(DT), b_kst.to(DT), input_precision=DOT_PREC)
    m = m_r[:, None] & m_s[None, :]
    if DIAG:
        m = m & (o_r[:, None] > o_s[None, :])
    b_decay = _gdn_decay(b_g_r, b_g_s, m)
    return b_kk * b_decay * (b_beta_r * b_r_r)[:, None] * b_r_s[None, :]


@triton.jit
def _gdn_unit_lower_inverse4(b_A0, b_A1, b_A2, b_A3, BC: tl.constexpr, DOT_PREC: tl.constexpr):
    """(I + A)^-1 of the chunk's four strictly lower [BC, BC] fp32 diagonal blocks, by forward
    substitution over rows: with N = (I + A)^-1 - I, row i is -A_i - A_i N (rows j >= i of N do not
    enter: A_ij = 0). The four run in one loop: their steps are independent, so the four one-row
    products of a step overlap instead of each block's 14 steps waiting on the previous block's."""
    o_c = tl.arange(0, BC)
    b_N0, b_N1, b_N2, b_N3 = -b_A0, -b_A1, -b_A2, -b_A3  # rows 0 and 1 are already final
    for i in range(2, BC):
        m_i = (o_c == i)[:, None]
        # A_i N as a one-row tl.dot: a row reduction would serialise on shuffles on GPUs and
        # is far slower in the Triton interpreter.
        b_r0 = tl.dot(tl.where(m_i, b_A0, 0.0), b_N0, input_precision=DOT_PREC)
        b_r1 = tl.dot(tl.where(m_i, b_A1, 0.0), b_N1, input_precision=DOT_PREC)
        b_r2 = tl.dot(tl.where(m_i, b_A2, 0.0), b_N2, input_precision=DOT_PREC)
        b_r3 = tl.dot(tl.where(m_i, b_A3, 0.0), b_N3, input_precision=DOT_PREC)
        b_N0 = tl.where(m_i, -(b_A0 + b_r0), b_N0)
        b_N1 = tl.where(m_i, -(b_A1 + b_r1), b_N1)
        b_N2 = tl.where(m_i, -(b_A2 + b_r2), b_N2)
        b_N3 = tl.where(m_i, -(b_A3 + b_r3), b_N3)
    b_I = (o_c[:, None] == o_c[None, :]).to(tl.float32)
    return b_N0 + b_I, b_N1 + b_I, b_N2 + b_I, b_N3 + b_I


@triton.jit
def _gdn_store_block(p_Ai, b_blk, o_r, m_r, col0, STRIDE: tl.constexpr, BC: tl.constexpr):
    o_c = tl.arange(0, BC)
    tl.store(p_Ai + o_r[:, None] * STRIDE + col0 + o_c[None, :], b_blk.to(p_Ai.dtype.element_ty), mask=m_r[:, None])


@triton.jit(do_not_specialize=["n_chunks"])
def _gdn_solve_fwd_kernel(
    k,
    rk,
    beta,
    g,
    a,
    A_log,
    dt_bias,
    gc,
    Ai,
    cu_seqlens,
    chunk_table,
    n_chunks,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    GATE_IN_KERNEL: tl.constexpr,
    L2NORM: tl.constexpr,
    DT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One program per (chunk, value head) tile, looping when tiles > programs (1-D grid).
    Writes gc [T, HV] (in-chunk cumsum of the log-decay, fp32) and Ai [T, HV, BT] ((I + A)^-1 rows,
    lower triangle only)."""
    i_p = tl.program_id(0)
    o_c = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    for i_tile in range(i_p, n_chunks * HV, tl.num_programs(0)):
        i_c, i_hv = i_tile // HV, i_tile % HV
        i_h = i_hv // (HV // H)
        i_n = tl.load(chunk_table + 2 * i_c)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        t0 = bos + tl.load(chunk_table + 2 * i_c + 1).to(tl.int64) * BT
        n_left = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - t0
        # Token rows of the four 16-row sub-blocks, relative to t0.
        o_0, o_1, o_2, o_3 = o_c, BC + o_c, 2 * BC + o_c, 3 * BC + o_c
        m_0, m_1, m_2, m_3 = o_0 < n_left, o_1 < n_left, o_2 < n_left, o_3 < n_left
        p_tok = t0 * HV + i_hv
        b_g0 = _gdn_gate(g, a, A_log, dt_bias, p_tok + o_0 * HV, m_0, i_hv, GATE_IN_KERNEL)
        b_g1 = _gdn_gate(g, a, A_log, dt_bias, p_tok + o_1 * HV, m_1, i_hv, GATE_IN_KERNEL)
        b_g2 = _gdn_gate(g, a, A_log, dt_bias, p_tok + o_2 * HV, m_2, i_hv, GATE_IN_KERNEL)
        b_g3 = _gdn_gate(g, a, A_log, dt_bias, p_tok + o_3 * HV, m_3, i_hv, GATE_IN_KERNEL)
        b_g0 = tl.cumsum(b_g0, 0)
        b_g1 = tl.cumsum(b_g1, 0) + tl.sum(b_g0 * (o_c == BC - 1), 0)
        b_g2 = tl.cumsum(b_g2, 0) + tl.sum(b_g1 * (o_c == BC - 1), 0)
        b_g3 = tl.cumsum(b_g3, 0) + tl.sum(b_g2 * (o_c == BC - 1), 0)
        tl.store(gc + p_tok + o_0 * HV, b_g0, mask=m_0)
        tl.store(gc + p_tok + o_1 * HV, b_g1, mask=m_1)
        tl.store(gc + p_tok + o_2 * HV, b_g2, mask=m_2)
        tl.store(gc + p_tok + o_3 * HV, b_g3, mask=m_3)
        b_b0 = tl.load(beta + p_tok + o_0 * HV, mask=m_0, other=0.0).to(tl.float32)
        b_b1 = tl.load(beta + p_tok + o_1 * HV, mask=m_1, other=0.0).to(tl.float32)
        b_b2 = tl.load(beta + p_tok + o_2 * HV, mask=m_2, other=0.0).to(tl.float32)
        b_b3 = tl.load(beta + p_tok + o_3 * HV, mask=m_3, other=0.0).to(tl.float32)
        b_r0 = _gdn_rstd(rk, t0, o_0, m_0, i_h, H, L2NORM)
        b_r1 = _gdn_rstd(rk, t0, o_1, m_1, i_h, H, L2NORM)
        b_r2 = _gdn_rstd(rk, t0, o_2, m_2, i_h, H, L2NORM)
        b_r3 = _gdn_rstd(rk, t0, o_3, m_3, i_h, H, L2NORM)

        p_k = k + t0 * (H * K) + i_h * K
        b_A00 = _gdn_a_block(p_k, o_0, m_0, o_0, m_0, o_k, m_k, b_b0, b_g0, b_g0, b_r0, b_r0, True, H * K, DT, DOT_PREC)
        b_A11 = _gdn_a_block(p_k, o_1, m_1, o_1, m_1, o_k, m_k, b_b1, b_g1, b_g1, b_r1, b_r1, True, H * K, DT, DOT_PREC)
        b_A22 = _gdn_a_block(p_k, o_2, m_2, o_2, m_2, o_k, m_k, b_b2, b_g2, b_g2, b_r2, b_r2, True, H * K, DT, DOT_PREC)
        b_A33 = _gdn_a_block(p_k, o_3, m_3, o_3, m_3, o_k, m_k, b_b3, b_g3, b_g3, b_r3, b_r3, True, H * K, DT, DOT_PREC)
        b_A10 = _gdn_a_block(
            p_k, o_1, m_1, o_0, m_0, o_k, m_k, b_b1, b_g1, b_g0, b_r1, b_r0, False, H * K, DT, DOT_PREC
        )
        b_A20 = _gdn_a_block(
            p_k, o_2, m_2, o_0, m_0, o_k, m_k, b_b2, b_g2, b_g0, b_r2, b_r0, False, H * K, DT, DOT_PREC
        )
        b_A21 = _gdn_a_block(
            p_k, o_2, m_2, o_1, m_1, o_k, m_k, b_b2, b_g2, b_g1, b_r2, b_r1, False, H * K, DT, DOT_PREC
        )
        b_A30 = _gdn_a_block(
            p_k, o_3, m_3, o_0, m_0, o_k, m_k, b_b3, b_g3, b_g0, b_r3, b_r0, False, H * K, DT, DOT_PREC
        )
        b_A31 = _gdn_a_block(
            p_k, o_3, m_3, o_1, m_1, o_k, m_k, b_b3, b_g3, b_g1, b_r3, b_r1, False, H * K, DT, DOT_PREC
        )
        b_A32 = _gdn_a_block(
            p_k, o_3, m_3, o_2, m_2, o_k, m_k, b_b3, b_g3, b_g2, b_r3, b_r2, False, H * K, DT, DOT_PREC
        )

        b_I00, b_I11, b_I22, b_I33 = _gdn_unit_lower_inverse4(b_A00, b_A11, b_A22, b_A33, BC, DOT_PREC)
        # Block forward substitution: Ai_rs = -Ai_rr sum_{s <= m < r} A_rm Ai_ms. Left operands are
        # expressions or dead afterwards (Ascend's tl.dot may overwrite its left operand).
        b_I10 = -tl.dot(b_I11 + 0.0, tl.dot(b_A10, b_I00, input_precision=DOT_PREC), input_precision=DOT_PREC)
        b_I21 = -tl.dot(b_I22 + 0.0, tl.dot(b_A21 + 0.0, b_I11, input_precision=DOT_PREC), input_precision=DOT_PREC)
        b_I32 = -tl.dot(b_I33 + 0.0, tl.dot(b_A32 + 0.0, b_I22, input_precision=DOT_PREC), input_precision=DOT_PREC)
        b_I20 = -tl.dot(
            b_I22 + 0.0,
            tl.dot(b_A20, b_I00, input_precision=DOT_PREC) + tl.dot(b_A21, b_I10, input_precision=DOT_PREC),
            input_precision=DOT_PREC,
        )
        b_I31 = -tl.dot(
            b_I33 + 0.0,
            tl.dot(b_A31 + 0.0, b_I11, input_precision=DOT_PREC) + tl.dot(b_A32 + 0.0, b_I21, input_precision=DOT_PREC),
            input_precision=DOT_PREC,
        )
        b_I30 = -tl.dot(
            b_I33 + 0.0,
            tl.dot(b_A30, b_I00, input_precision=DOT_PREC)
            + tl.dot(b_A31, b_I10, input_precision=DOT_PREC)
            + tl.dot(b_A32, b_I20, input_precision=DOT_PREC),
            input_precision=DOT_PREC,
        )

        p_Ai = Ai + p_tok * BT
        _gdn_store_block(p_Ai, b_I00, o_0, m_0, 0, HV * BT, BC)
        _gdn_store_block(p_Ai, b_I10, o_1, m_1, 0, HV * BT, BC)
        _gdn_store_block(p_Ai, b_I11, o_1, m_1, BC, HV * BT, BC)
        _gdn_store_block(p_Ai, b_I20, o_2, m_2, 0, HV * BT, BC)
        _gdn_store_block(p_Ai, b_I21, o_2, m_2, BC, HV * BT, BC)
        _gdn_store_block(p_Ai, b_I22, o_2, m_2, 2 * BC, HV * BT, BC)
        _gdn_store_block(p_Ai, b_I30, o_3, m_3, 0, HV * BT, BC)
        _gdn_store_block(p_Ai, b_I31, o_3, m_3, BC, HV * BT, BC)
        _gdn_store_block(p_Ai, b_I32, o_3, m_3, 2 * BC, HV * BT, BC)
        _gdn_store_block(p_Ai, b_I33, o_3, m_3, 3 * BC, HV * BT, BC)


def _solve_meta(shape: dict) -> dict:
    return {"BT": BT, "BC": BC, "BK": next_pow2(shape["K"])}


def _solve_grid(meta: dict) -> tuple[int]:
    return grid_1d(meta["n_chunks"] * meta["HV"])


def _solve_max_tiles(shape: dict) -> dict:
    return {"n_chunks": cdiv(shape["T"], BT) + shape["N"]}


KERNEL_LAUNCHES = {
    "_gdn_solve_fwd_kernel": {
        "configs": SOLVE_CONFIGS,
        "meta": _solve_meta,
        "grid": _solve_grid,
        "runtime": _solve_max_tiles,
        "max_shapes": MAX_SHAPES,
    },
}


def gdn_solve_fwd(
    k: torch.Tensor, rk, beta: torch.Tensor, g: torch.Tensor | None, gate: tuple | None, plan: ChunkPlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """k [B, T, H, K], beta [B, T, HV], g [B, T, HV] or gate = (a [B, T, HV], A_log [HV], dt_bias [HV])
    -> gc [B, T, HV] fp32 (in-chunk cumsum of the log-decay), Ai [B, T, HV, BT] in k's dtype."""
    B, T, H, K = k.shape
    HV = beta.shape[2]
    gc = torch.empty(B, T, HV, dtype=torch.float32, device=k.device)
    Ai = torch.empty(B, T, HV, BT, dtype=k.dtype, device=k.device)
    a, A_log, dt_bias = gate if gate is not None else (None, None, None)
    args = dict(
        k=k,
        rk=rk,
        beta=beta,
        g=g,
        a=a,
        A_log=A_log,
        dt_bias=dt_bias,
        gc=gc,
        Ai=Ai,
        cu_seqlens=plan.cu_seqlens,
        chunk_table=plan.chunk_table,
        n_chunks=plan.NT,
        H=H,
        HV=HV,
        K=K,
        GATE_IN_KERNEL=gate is not None,
        L2NORM=rk is not None,
        DT=dot_dtype(k.dtype),
        DOT_PREC=dot_precision(k.dtype),
        **_solve_meta({"K": K}),
    )
    if plan.NT > 0:
        launch(_gdn_solve_fwd_kernel, SOLVE_CONFIGS, ["H", "HV", "K"], _solve_grid, **args)
    return gc, Ai
