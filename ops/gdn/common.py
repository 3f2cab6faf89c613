"""Small Triton helpers shared by the GDN stage kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _gdn_chunk_coords(i_c, cu_seqlens, chunk_table, BT: tl.constexpr):
    """(first token of chunk i_c, tokens left in its sequence from there), both int64."""
    i_n = tl.load(chunk_table + 2 * i_c)
    t0 = tl.load(cu_seqlens + i_n).to(tl.int64) + tl.load(chunk_table + 2 * i_c + 1).to(tl.int64) * BT
    return t0, tl.load(cu_seqlens + i_n + 1).to(tl.int64) - t0


@triton.jit
def _gdn_decay(b_g_i, b_g_j, m):
    """exp(G_i - G_j) on the mask m, 0 elsewhere ([BT, BT] fp32). The exponent is masked first: off
    the mask it may be huge and positive, and exp(inf) * 0 would be NaN."""
    return tl.exp(tl.where(m, b_g_i[:, None] - b_g_j[None, :], float("-inf")))


@triton.jit
def _gdn_rstd(rstd, t0, o_t, m_t, i_h, H: tl.constexpr, L2NORM: tl.constexpr):
    """l2norm factor 1 / |x| of q/k head i_h for tokens t0 + o_t ([BT] fp32; 1 without l2norm).
    The kernels multiply it into fp32 scores and scalings rather than storing normalised q/k,
    which would add one more 16-bit rounding of every q/k element."""
    if L2NORM:
        return tl.load(rstd + (t0 + o_t) * H + i_h, mask=m_t, other=0.0)
    else:
        return tl.where(m_t, 1.0, 0.0)


@triton.jit
def _gdn_load_ai(p_Ai, o_t, m_t, TRANSPOSE: tl.constexpr, STRIDE: tl.constexpr):
    """The chunk's (I + A)^-1 as a [BT, BT] tile (or its transpose), read through pointers."""
    if TRANSPOSE:
        m = (o_t[:, None] <= o_t[None, :]) & m_t[None, :]
        return tl.load(p_Ai + o_t[None, :] * STRIDE + o_t[:, None], mask=m, other=0.0)
    else:
        m = (o_t[:, None] >= o_t[None, :]) & m_t[:, None]
        return tl.load(p_Ai + o_t[:, None] * STRIDE + o_t[None, :], mask=m, other=0.0)
