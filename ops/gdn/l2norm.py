"""q/k l2-normalisation factors, and the q/k gradient epilogue.

Forward (use_qk_l2norm_in_kernel): rstd = 1 / sqrt(sum(x^2) + 1e-6) per (token, head); the stage
kernels apply it to raw q/k in fp32 (see `common._gdn_rstd`), so normalised q/k never exist.
Backward: the chunk stages produce gradients for the normalised q/k per value head ([T, HV, K] in
the input dtype, no atomics); here the HV // H value heads of each q/k head are summed, then the l2norm backward
dx = rstd * (dx_n - x_n (x_n . dx_n)), x_n = x * rstd, is applied when the forward normalised.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import MAX_SHAPES, cdiv, grid_1d, launch, next_pow2

L2NORM_CONFIGS = [{"BR": 32, "num_warps": 4}]
QK_BWD_CONFIGS = [{"BR": 32, "num_warps": 4}]
EPS = 1e-6


@triton.jit(do_not_specialize=["n_rows"])
def _gdn_l2norm_fwd_kernel(
    q, k, rq, rk, n_rows, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, EPS: tl.constexpr
):
    """One program per block of BR rows of q and k [rows, K] (1-D grid, looping): rq, rk [rows] fp32.
    Both in one launch: the forward's first kernels are short, so a second launch is host time the
    device waits for."""
    i_p = tl.program_id(0)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    for i_blk in range(i_p, tl.cdiv(n_rows, BR), tl.num_programs(0)):
        o_r = (i_blk * BR + tl.arange(0, BR)).to(tl.int64)
        m = (o_r < n_rows)[:, None] & m_k[None, :]
        b_q = tl.load(q + o_r[:, None] * K + o_k[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(rq + o_r, 1.0 / tl.sqrt(tl.sum(b_q * b_q, 1) + EPS), mask=o_r < n_rows)
        b_k = tl.load(k + o_r[:, None] * K + o_k[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(rk + o_r, 1.0 / tl.sqrt(tl.sum(b_k * b_k, 1) + EPS), mask=o_r < n_rows)


@triton.jit
def _gdn_qk_rows_bwd(
    dx_hv,
    x,
    rstd,
    dx,
    o_r,
    m,
    o_k,
    n_rows,
    G: tl.constexpr,
    K: tl.constexpr,
    BR: tl.constexpr,
    BK: tl.constexpr,
    L2NORM: tl.constexpr,
):
    """Rows o_r (masked by m) of one of q / k: the G value-head gradients summed in fp32, then the
    l2norm backward when the forward normalised."""
    b_d = tl.zeros([BR, BK], dtype=tl.float32)
    for i_g in range(0, G):
        p = (o_r * G + i_g)[:, None] * K + o_k[None, :]
        b_d += tl.load(dx_hv + p, mask=m, other=0.0).to(tl.float32)
    if L2NORM:
        b_r = tl.load(rstd + o_r, mask=o_r < n_rows, other=0.0)
        b_xn = tl.load(x + o_r[:, None] * K + o_k[None, :], mask=m, other=0.0).to(tl.float32) * b_r[:, None]
        b_d = b_r[:, None] * (b_d - b_xn * tl.sum(b_xn * b_d, 1)[:, None])
    tl.store(dx + o_r[:, None] * K + o_k[None, :], b_d.to(dx.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["n_rows"])
def _gdn_qk_bwd_kernel(
    dq_hv,
    q,
    rq,
    dq,
    dk_hv,
    k,
    rk,
    dk,
    n_rows,
    G: tl.constexpr,
    K: tl.constexpr,
    BK: tl.constexpr,
    BR: tl.constexpr,
    L2NORM: tl.constexpr,
):
    """One program per block of BR q/k rows (token, head) (1-D grid, looping): sums the G value-head
    gradients dq_hv / dk_hv [rows * G, K] (any float dtype) in fp32 and applies the l2norm backward
    -> dq, dk [rows, K]. q and k in one launch, as in the forward."""
    i_p = tl.program_id(0)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    for i_blk in range(i_p, tl.cdiv(n_rows, BR), tl.num_programs(0)):
        o_r = (i_blk * BR + tl.arange(0, BR)).to(tl.int64)
        m = (o_r < n_rows)[:, None] & m_k[None, :]
        _gdn_qk_rows_bwd(dq_hv, q, rq, dq, o_r, m, o_k, n_rows, G, K, BR, BK, L2NORM)
        _gdn_qk_rows_bwd(dk_hv, k, rk, dk, o_r, m, o_k, n_rows, G, K, BR, BK, L2NORM)


def _rows_meta(shape: dict) -> dict:
    return {"BK": next_pow2(shape["K"])}


def _rows_grid(meta: dict) -> tuple[int]:
    return grid_1d(cdiv(meta["n_rows"], meta["BR"]))


def _max_rows(shape: dict) -> dict:
    return {"n_rows": shape["T"] * shape["H"]}


KERNEL_LAUNCHES = {
    "_gdn_l2norm_fwd_kernel": {
        "configs": L2NORM_CONFIGS,
        "meta": _rows_meta,
        "grid": _rows_grid,
        "runtime": _max_rows,
        "max_shapes": MAX_SHAPES,
    },
    "_gdn_qk_bwd_kernel": {
        "configs": QK_BWD_CONFIGS,
        "meta": _rows_meta,
        "grid": _rows_grid,
        "runtime": _max_rows,
        "max_shapes": MAX_SHAPES,
    },
}


def gdn_l2norm_fwd(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, T, H, K] -> rq, rk [B, T, H] fp32, each 1 / sqrt(sum(x^2) + 1e-6)."""
    K = q.shape[-1]
    rq = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    rk = torch.empty_like(rq)
    if q.numel() > 0:
        launch(
            _gdn_l2norm_fwd_kernel,
            L2NORM_CONFIGS,
            ["K"],
            _rows_grid,
            q=q,
            k=k,
            rq=rq,
            rk=rk,
            n_rows=q.numel() // K,
            K=K,
            EPS=EPS,
            **_rows_meta({"K": K}),
        )
    return rq, rk


def gdn_qk_bwd(dq_hv, dk_hv, q: torch.Tensor, k: torch.Tensor, rq, rk) -> tuple[torch.Tensor, torch.Tensor]:
    """dq_hv / dk_hv [B, T, HV, K] gradients of the normalised q / k per value head (summed in fp32),
    q / k [B, T, H, K] raw, rq / rk [B, T, H] or None (no l2norm) -> dq, dk [B, T, H, K] in q's dtype."""
    B, T, H, K = q.shape
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    if dq.numel() > 0:
        launch(
            _gdn_qk_bwd_kernel,
            QK_BWD_CONFIGS,
            ["G", "K"],
            _rows_grid,
            dq_hv=dq_hv,
            q=q,
            rq=rq,
            dq=dq,
            dk_hv=dk_hv,
            k=k,
            rk=rk,
            dk=dk,
            n_rows=B * T * H,
            G=dq_hv.shape[2] // H,
            K=K,
            L2NORM=rq is not None,
            **_rows_meta({"K": K}),
        )
    return dq, dk
