"""Exact mode's gated delta rule on devices: one Triton kernel that runs the per-token recurrence for the
trainer's packed forward, the rollout's prefill and its decode step alike.

A program owns one (sequence, value head, block of BV value columns) state tile [K, BV] in registers and
walks the sequence's tokens in order; a decode step is the same kernel over sequences of one token. Each
token's update (decay, delta correction, read-out) is the same instructions on the same operands in every
use, so a token's output and the state it leaves are bitwise equal in all three. Value columns are
independent in the delta rule, so the block split does not enter a column's arithmetic. The chunked
kernels (`chunk.py`) remain the fast form, and exact mode's gradient (`exact.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.launch import cdiv, grid_1d, launch, next_pow2
from .step import rows_of_contiguous_heads
from .step_kernel import STEP_CONFIGS

# One config for every use (a token's sums over K follow the tile's layout across threads): the fast
# one-token step's, the fastest at a decode step's shape, so exact mode's decode step runs at its speed.
CONFIG = STEP_CONFIGS[0]
MAX_K = 128  # the whole K of a state tile lives in one program (Ascend: K/V tiles <= 128)
MAX_SHAPES = ({"N": 4096, "HV": 64, "K": 128, "V": 128},)


@triton.jit(do_not_specialize=["N"])
def _gdn_rows_kernel(
    q,
    k,
    v,
    g,
    beta,
    state_in,
    state_out,
    o,
    seq_start,
    seq_len,
    scale,
    N,
    s_q,
    s_k,
    s_v,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    INPLACE: tl.constexpr,
    ROW_PER_SEQ: tl.constexpr,
):
    """Rows q, k [T, H, K], v [T, HV, V] (row strides s_q, s_k, s_v, each row's heads contiguous), g, beta
    [T, HV], o [T, HV, V]; sequence n is rows
    seq_start[n] + [0, seq_len[n]) with state state_in[n] [HV, K, V] fp32 before and state_out[n] after
    (INPLACE: state_out is state_in, a tile read before its only write; else every tile is written).
    ROW_PER_SEQ (a decode step): sequence n is row n, seq_start is not read, seq_len[n] is 0 or 1 (any integer
    or bool dtype) and a row of no token gets a zero output (o is not zero-filled first)."""
    i_p, n_p = tl.program_id(0), tl.num_programs(0)
    NV = tl.cdiv(V, BV)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    for i_w in range(i_p, N * HV * NV, n_p):
        i_nh, i_v = i_w // NV, i_w % NV
        i_n, i_hv = i_nh // HV, i_nh % HV
        i_h = i_hv // (HV // H)
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        n_t = tl.load(seq_len + i_n).to(tl.int32)
        p_s = i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
        m_s = m_k[:, None] & m_v[None, :]
        if INPLACE:  # a sequence of no tokens (an idle slot of a decode step) neither reads nor writes its state
            m_s = m_s & (tl.zeros([BK, BV], dtype=tl.int32) + n_t > 0)
        b_s = tl.load(state_in + p_s, mask=m_s, other=0.0).to(tl.float32)
        if ROW_PER_SEQ:
            row0 = i_n.to(tl.int64)
            m_idle = m_v & (tl.zeros([BV], dtype=tl.int32) + n_t == 0)  # a row of no token: zeros
            tl.store(o + (row0 * HV + i_hv) * V + o_v, tl.zeros([BV], dtype=o.dtype.element_ty), mask=m_idle)
        else:
            row0 = tl.load(seq_start + i_n).to(tl.int64)
        for t in range(0, n_t):
            row = row0 + t
            p_qk = i_h * K + o_k
            b_q = tl.load(q + row * s_q + p_qk, mask=m_k, other=0.0).to(tl.float32)
            b_k = tl.load(k + row * s_k + p_qk, mask=m_k, other=0.0).to(tl.float32)
            if USE_QK_L2NORM:
                b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 0) + 1e-6)
                b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 0) + 1e-6)
            b_q = b_q * scale
            p_hv = row * HV + i_hv
            b_v = tl.load(v + row * s_v + i_hv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            b_s = b_s * tl.exp(tl.load(g + p_hv).to(tl.float32))
            b_u = tl.load(beta + p_hv).to(tl.float32) * (b_v - tl.sum(b_s * b_k[:, None], 0))
            b_s = b_s + b_k[:, None] * b_u[None, :]
            b_o = tl.sum(b_s * b_q[:, None], 0)
            tl.store(o + p_hv * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        tl.store(state_out + p_s, b_s, mask=m_s)


def _grid(meta: dict) -> tuple[int]:
    return grid_1d(meta["N"] * meta["HV"] * cdiv(meta["V"], meta["BV"]))


KERNEL_LAUNCHES = {
    "_gdn_rows_kernel": {
        "configs": [CONFIG],
        "meta": lambda shape: {"BK": next_pow2(shape["K"])},
        "grid": _grid,
        "runtime": lambda shape: {},
        "max_shapes": MAX_SHAPES,
    },
}


def gated_delta_rule_rows_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    seq_start: torch.Tensor | None,
    seq_len: torch.Tensor,
    scale: float,
    use_qk_l2norm_in_kernel: bool,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows q, k [T, H, K], v [T, HV, V], g, beta [T, HV]; N sequences at rows seq_start[n] +
    [0, seq_len[n]) ([N] int tensors) with states state [N, HV, K, V] fp32. Returns o [T, HV, V] in v's
    dtype (rows no sequence covers are zeros) and the states after each sequence (written into `state`
    when inplace, else a new tensor). seq_start None: a decode step, sequence n is row n with seq_len[n]
    (bool or 0 / 1) tokens: no offsets to build and no zero fill first."""
    T, H, K = q.shape
    N, HV, _, V = state.shape
    if K > MAX_K:
        raise ValueError(f"the Triton exact gated delta rule holds K <= {MAX_K} per program, got K={K}")
    if v.dtype == torch.float64 or state.dtype != torch.float32:
        raise ValueError(f"the Triton exact gated delta rule computes in fp32, got v {v.dtype}, state {state.dtype}")
    if inplace and not state.is_contiguous():
        raise ValueError("an in-place step needs a contiguous state")
    q, k, v = rows_of_contiguous_heads(q, k, v)
    g, beta = g.contiguous(), beta.contiguous()
    state_in = state.contiguous()
    state_out = state_in if inplace else torch.empty_like(state_in)
    row_per_seq = seq_start is None
    if row_per_seq:  # the kernel writes every row (zeros where seq_len is 0)
        if T != N:
            raise ValueError(f"a decode step's form (seq_start None) takes one row per sequence, got {T} rows for {N}")
        o, seq_start = torch.empty(T, HV, V, dtype=v.dtype, device=v.device), seq_len
        seq_len = seq_len.contiguous().view(torch.uint8) if seq_len.dtype == torch.bool else seq_len
    else:
        o = torch.zeros(T, HV, V, dtype=v.dtype, device=v.device)
    if N:
        launch(
            _gdn_rows_kernel,
            [CONFIG],
            ["H", "HV", "K", "V"],
            _grid,
            restore=("state_out",) if inplace else (),  # an autotune trial must not advance the state
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            state_in=state_in,
            state_out=state_out,
            o=o,
            seq_start=seq_start.contiguous(),  # one per sequence at n * 1 (not read when ROW_PER_SEQ)
            seq_len=seq_len.contiguous(),
            scale=float(scale),
            N=N,
            s_q=q.stride(0),
            s_k=k.stride(0),
            s_v=v.stride(0),
            H=H,
            HV=HV,
            K=K,
            V=V,
            BK=next_pow2(K),
            USE_QK_L2NORM=use_qk_l2norm_in_kernel,
            INPLACE=inplace,
            ROW_PER_SEQ=row_per_seq,
        )
    if inplace and state_out.data_ptr() != state.data_ptr():
        state.copy_(state_out)
        state_out = state
    return o, state_out


__all__ = ["gated_delta_rule_rows_triton"]
