"""Triton RoPE: q and k rotated in one launch, forward and backward.

Forward, per row (token, head) of q or k: with x1, x2 the two halves of the first rotary_dim
features (rotate_half pairing) and c, s the token's cos/sin row split the same way,
y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2; features past rotary_dim are copied. Backward applies the
transposed rotation to the output gradients: dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1 (cos/sin
get no gradient). Math in fp32 (fp64 for fp64 inputs), one rounding to the input dtype; the
reference rounds each product and the sum in the input dtype, so in bf16 the two differ by about
one bf16 ulp and this path is the closer one to fp64.

q and k may be strided views (e.g. a split of q_proj's output): any batch/token/head strides with a
contiguous last dim are read in place; outputs are new contiguous tensors; nothing saved but cos/sin.

One program per block of BT tokens: their cos/sin rows are loaded once and applied to every q and k
head ([BT, heads, features] tiles, HEAD_GROUP heads at a time), and all of a head group's loads (both
rotary halves, the copied features) are issued before its stores: one DRAM round trip per group.

Ascend rules: 1-D grid <= 65535 looping over token blocks, power-of-two tiles (K in chunks of <= 128,
the rotary halves as one tile of next_pow2(rotary_dim / 2) <= 128, heads padded to a power of two),
no atomics, no transposes, guards on constexprs only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.launch import cdiv, grid_1d, launch, next_pow2
from .reference import check_rope_inputs

# Tokens per block: a program rotates every q and k head of BT tokens with their cos/sin rows loaded
# once, HEAD_GROUP heads at a time; all of a group's loads are issued before its stores (one DRAM
# round trip per group, BT * HEAD_GROUP * K * 2 bytes in flight: 16 KiB for bf16, BT = 4, K = 256).
# The first config is the small safe one the interpreter and deterministic mode run.
ROPE_CONFIGS = [
    {"BT": 2, "num_warps": 4},
    {"BT": 4, "num_warps": 4},
    {"BT": 4, "num_warps": 8},
    {"BT": 8, "num_warps": 8},
]
HEAD_GROUP = 8
MAX_K = 256  # head dims up to 256: the rotary half tile and the two feature chunks stay <= 128
# Documented largest shapes for the static rule check: 1M tokens, 64 q heads, 16 kv heads, K = 256,
# full (256) and Qwen3.5's partial (64) rotary.
MAX_SHAPES = (
    {"T": 1 << 20, "H": 64, "HKV": 16, "K": 256, "R": 256},
    {"T": 1 << 20, "H": 64, "HKV": 16, "K": 256, "R": 64},
)
_COMPUTE = {torch.float64: tl.float64}


@triton.jit
def _rope_heads(
    x,
    y,
    o_t,
    m_t,
    p_xt,
    o_g,
    b_c1,
    b_c2,
    b_s1,
    b_s2,
    s_xh,
    H: tl.constexpr,
    K: tl.constexpr,
    R: tl.constexpr,
    BG: tl.constexpr,
    BH: tl.constexpr,
    BK: tl.constexpr,
    CT: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    """The H heads of tokens o_t [BT] (mask m_t) of x (element offsets p_xt [BT] of each token's head 0,
    head stride s_xh, last dim contiguous) -> y [tokens, H, K] contiguous, BG heads at a time as
    [BT, BG, features] tiles (o_g = arange(BG)); b_c1 .. b_s2: [BT, BH] halves of the tokens' cos/sin
    rows, shared by every head."""
    o_d = tl.arange(0, BH)
    o_k = tl.arange(0, BK)
    b_c1, b_c2, b_s1, b_s2 = b_c1[:, None, :], b_c2[:, None, :], b_s1[:, None, :], b_s2[:, None, :]
    for i_h in range(0, H, BG):
        m_th = m_t[:, None] & (i_h + o_g < H)[None, :]
        p_x = x + (p_xt[:, None] + (i_h + o_g)[None, :] * s_xh)[:, :, None]
        p_y = y + (o_t[:, None] * (H * K) + (i_h + o_g)[None, :] * K)[:, :, None]
        m_d = m_th[:, :, None] & (o_d < R // 2)[None, None, :]
        b_x1 = tl.load(p_x + o_d[None, None, :], mask=m_d, other=0.0)
        b_x2 = tl.load(p_x + R // 2 + o_d[None, None, :], mask=m_d, other=0.0)
        # Features past rotary_dim pass unchanged (a bitwise copy), in at most two BK chunks
        # (K <= 2 BK), loaded before the group's first store.
        m_a = m_th[:, :, None] & ((o_k >= R) & (o_k < K))[None, None, :]
        m_b = m_th[:, :, None] & ((o_k + BK >= R) & (o_k + BK < K))[None, None, :]
        if R < K:
            b_a = tl.load(p_x + o_k[None, None, :], mask=m_a, other=0.0)
            if K > BK:
                b_b = tl.load(p_x + BK + o_k[None, None, :], mask=m_b, other=0.0)
        b_x1 = b_x1.to(CT)
        b_x2 = b_x2.to(CT)
        if BACKWARD:
            b_y1 = b_x1 * b_c1 + b_x2 * b_s2
            b_y2 = b_x2 * b_c2 - b_x1 * b_s1
        else:
            b_y1 = b_x1 * b_c1 - b_x2 * b_s1
            b_y2 = b_x2 * b_c2 + b_x1 * b_s2
        tl.store(p_y + o_d[None, None, :], b_y1.to(y.dtype.element_ty), mask=m_d)
        tl.store(p_y + R // 2 + o_d[None, None, :], b_y2.to(y.dtype.element_ty), mask=m_d)
        if R < K:
            tl.store(p_y + o_k[None, None, :], b_a.to(y.dtype.element_ty), mask=m_a)
            if K > BK:
                tl.store(p_y + BK + o_k[None, None, :], b_b.to(y.dtype.element_ty), mask=m_b)


@triton.jit(do_not_specialize=["n_tokens", "T"])
def _rope_kernel(
    q,
    k,
    yq,
    yk,
    cos,
    sin,
    n_tokens,
    T,
    s_qb,
    s_qt,
    s_qh,
    s_kb,
    s_kt,
    s_kh,
    s_cb,
    s_ct,
    H: tl.constexpr,
    HKV: tl.constexpr,
    K: tl.constexpr,
    R: tl.constexpr,
    BT: tl.constexpr,
    BGQ: tl.constexpr,
    BGK: tl.constexpr,
    BH: tl.constexpr,
    BK: tl.constexpr,
    CT: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    """Rotate (BACKWARD: rotate back) q [B, T, H, K] and k [B, T, HKV, K] -> yq, yk, contiguous.
    1-D grid; each program loops over blocks of BT of the B * T tokens: the block's cos/sin rows are
    loaded once, then its q heads (BGQ at a time) and its k heads (BGK at a time) are rotated."""
    i_p = tl.program_id(0)
    o_d = tl.arange(0, BH)
    o_gq = tl.arange(0, BGQ)
    o_gk = tl.arange(0, BGK)
    for i_blk in range(i_p, tl.cdiv(n_tokens, BT), tl.num_programs(0)):
        o_t = (i_blk * BT + tl.arange(0, BT)).to(tl.int64)
        m_t = o_t < n_tokens
        i_b, i_t = o_t // T, o_t % T
        p_c = cos + (i_b * s_cb + i_t * s_ct)[:, None] + o_d[None, :]
        p_s = sin + (i_b * s_cb + i_t * s_ct)[:, None] + o_d[None, :]
        m_c = m_t[:, None] & (o_d < R // 2)[None, :]
        b_c1 = tl.load(p_c, mask=m_c, other=0.0).to(CT)
        b_c2 = tl.load(p_c + R // 2, mask=m_c, other=0.0).to(CT)
        b_s1 = tl.load(p_s, mask=m_c, other=0.0).to(CT)
        b_s2 = tl.load(p_s + R // 2, mask=m_c, other=0.0).to(CT)
        p_qt, p_kt = i_b * s_qb + i_t * s_qt, i_b * s_kb + i_t * s_kt
        _rope_heads(q, yq, o_t, m_t, p_qt, o_gq, b_c1, b_c2, b_s1, b_s2, s_qh, H, K, R, BGQ, BH, BK, CT, BACKWARD)
        _rope_heads(k, yk, o_t, m_t, p_kt, o_gk, b_c1, b_c2, b_s1, b_s2, s_kh, HKV, K, R, BGK, BH, BK, CT, BACKWARD)


def _rope_meta(shape: dict) -> dict:
    return {
        "BGQ": min(HEAD_GROUP, next_pow2(shape["H"], lo=1)),
        "BGK": min(HEAD_GROUP, next_pow2(shape["HKV"], lo=1)),
        "BH": next_pow2(shape["R"] // 2),
        "BK": min(128, next_pow2(shape["K"])),
    }


def _rope_grid(meta: dict) -> tuple[int]:
    return grid_1d(cdiv(meta["n_tokens"], meta["BT"]))


def _rope_tokens(shape: dict) -> dict:
    return {"n_tokens": shape["T"]}


KERNEL_LAUNCHES = {
    "_rope_kernel": {
        "configs": ROPE_CONFIGS,
        "meta": _rope_meta,
        "grid": _rope_grid,
        "runtime": _rope_tokens,
        "max_shapes": MAX_SHAPES,
    },
}


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def rope_rotate(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, H, K], k [B, T, HKV, K], cos/sin [B, T, R] -> rotated (backward: rotated back) q, k,
    new contiguous tensors in the input dtypes."""
    B, T, H, K = q.shape
    R = cos.shape[-1]
    q, k, cos, sin = (_last_dim_contiguous(t) for t in (q, k, cos, sin))
    yq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    yk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if yq.numel() + yk.numel() == 0:
        return yq, yk
    launch(
        _rope_kernel,
        ROPE_CONFIGS,
        ["H", "HKV", "K", "R", "BACKWARD"],
        _rope_grid,
        q=q,
        k=k,
        yq=yq,
        yk=yk,
        cos=cos,
        sin=sin,
        n_tokens=B * T,
        T=T,
        s_qb=q.stride(0),
        s_qt=q.stride(1),
        s_qh=q.stride(2),
        s_kb=k.stride(0),
        s_kt=k.stride(1),
        s_kh=k.stride(2),
        s_cb=cos.stride(0),
        s_ct=cos.stride(1),
        H=H,
        HKV=k.shape[2],
        K=K,
        R=R,
        CT=_COMPUTE.get(q.dtype, tl.float32),
        BACKWARD=backward,
        **_rope_meta({"H": H, "HKV": k.shape[2], "K": K, "R": R}),
    )
    return yq, yk


class RotaryPosEmbFunction(torch.autograd.Function):
    """(q, k, cos, sin) -> rotated (q, k); saves only cos/sin (the rotation is recomputed transposed)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rope_rotate(q, k, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = rope_rotate(dq, dk, cos, sin, backward=True)
        return dq, dk, None, None


def apply_rotary_pos_emb_fused(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dispatched `rope` op in Triton (`apply_rotary_pos_emb_ref`'s contract).

    Args:
        q: [B, T, H, K]; k: [B, T, HKV, K]; float16/bfloat16/float32/float64, any strides (a last dim
            that is not contiguous is copied first); K <= 256.
        cos, sin: [B, T, rotary_dim] (even rotary_dim <= K), any float dtype; they take no gradient.
    Returns:
        q, k rotated, new contiguous tensors in the input dtypes.
    Raises:
        ValueError: shape mismatch, K > 256, non-float inputs, tensors on different devices, or
            cos/sin that require grad.
    """
    check_rope_inputs(q, k, cos, sin)
    if q.shape[-1] > MAX_K:
        raise ValueError(f"triton rope takes head dims up to {MAX_K}, got K={q.shape[-1]}")
    if not all(t.is_floating_point() for t in (q, k, cos, sin)):
        raise ValueError(f"q, k, cos, sin must be floating, got {q.dtype}, {k.dtype}, {cos.dtype}, {sin.dtype}")
    if len({t.device for t in (q, k, cos, sin)}) != 1:
        raise ValueError(f"q, k, cos, sin must be on one device, got {[str(t.device) for t in (q, k, cos, sin)]}")
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError("triton rope gives cos/sin no gradient: pass them detached (or use the torch rope)")
    return RotaryPosEmbFunction.apply(q, k, cos, sin)
