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

Ascend rules: 1-D grid <= 65535 looping over row blocks, power-of-two tiles (K in chunks of <= 128,
the rotary halves as one tile of next_pow2(rotary_dim / 2) <= 128), no atomics, no transposes,
guards on constexprs only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.launch import cdiv, grid_1d, launch, next_pow2
from .reference import check_rope_inputs

# Rows (token, head) per block. Memory-bound: a [BR, 128] tile of 16-bit values per step; the first
# config is the small safe one the interpreter and deterministic mode run.
ROPE_CONFIGS = [
    {"BR": 16, "num_warps": 4},
    {"BR": 32, "num_warps": 4},
    {"BR": 64, "num_warps": 8},
    {"BR": 128, "num_warps": 8},
]
MAX_K = 256  # head dims up to 256: the rotary half tile stays <= 128
# Documented largest shapes for the static rule check: 1M tokens, 64 q heads, 16 kv heads, K = 256,
# full (256) and Qwen3.5's partial (64) rotary.
MAX_SHAPES = (
    {"T": 1 << 20, "H": 64, "HKV": 16, "K": 256, "R": 256},
    {"T": 1 << 20, "H": 64, "HKV": 16, "K": 256, "R": 64},
)
_COMPUTE = {torch.float64: tl.float64}


@triton.jit
def _rope_block(
    x,
    y,
    cos,
    sin,
    i_blk,
    n_rows,
    T,
    s_xb,
    s_xt,
    s_xh,
    s_cb,
    s_ct,
    H: tl.constexpr,
    K: tl.constexpr,
    R: tl.constexpr,
    BR: tl.constexpr,
    BH: tl.constexpr,
    BK: tl.constexpr,
    CT: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    """Rows i_blk * BR ... of x [B, T, H, K] (strided, last dim contiguous) -> y [B*T*H, K] contiguous."""
    o_r = (i_blk * BR + tl.arange(0, BR)).to(tl.int64)
    m_r = o_r < n_rows
    i_bt = o_r // H
    p_x = x + (i_bt // T) * s_xb + (i_bt % T) * s_xt + (o_r % H) * s_xh
    p_c = (i_bt // T) * s_cb + (i_bt % T) * s_ct
    p_y = y + o_r * K
    o_h = tl.arange(0, BH)
    m_h = m_r[:, None] & (o_h < R // 2)[None, :]
    b_x1 = tl.load(p_x[:, None] + o_h[None, :], mask=m_h, other=0.0).to(CT)
    b_x2 = tl.load(p_x[:, None] + R // 2 + o_h[None, :], mask=m_h, other=0.0).to(CT)
    b_c1 = tl.load(cos + p_c[:, None] + o_h[None, :], mask=m_h, other=0.0).to(CT)
    b_c2 = tl.load(cos + p_c[:, None] + R // 2 + o_h[None, :], mask=m_h, other=0.0).to(CT)
    b_s1 = tl.load(sin + p_c[:, None] + o_h[None, :], mask=m_h, other=0.0).to(CT)
    b_s2 = tl.load(sin + p_c[:, None] + R // 2 + o_h[None, :], mask=m_h, other=0.0).to(CT)
    if BACKWARD:
        b_y1 = b_x1 * b_c1 + b_x2 * b_s2
        b_y2 = b_x2 * b_c2 - b_x1 * b_s1
    else:
        b_y1 = b_x1 * b_c1 - b_x2 * b_s1
        b_y2 = b_x2 * b_c2 + b_x1 * b_s2
    tl.store(p_y[:, None] + o_h[None, :], b_y1.to(y.dtype.element_ty), mask=m_h)
    tl.store(p_y[:, None] + R // 2 + o_h[None, :], b_y2.to(y.dtype.element_ty), mask=m_h)
    # Features past rotary_dim pass unchanged (a bitwise copy; no chunk is loaded when R == K).
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        m = m_r[:, None] & ((o_k >= R) & (o_k < K))[None, :]
        b_p = tl.load(p_x[:, None] + o_k[None, :], mask=m, other=0.0)
        tl.store(p_y[:, None] + o_k[None, :], b_p.to(y.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["n_rows_q", "n_rows_k", "T"])
def _rope_kernel(
    q,
    k,
    yq,
    yk,
    cos,
    sin,
    n_rows_q,
    n_rows_k,
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
    BR: tl.constexpr,
    BH: tl.constexpr,
    BK: tl.constexpr,
    CT: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    """Rotate (BACKWARD: rotate back) q [B, T, H, K] and k [B, T, HKV, K] -> yq, yk, contiguous.
    1-D grid; each program loops over the BR-row blocks of q, then over those of k."""
    i_p = tl.program_id(0)
    for i_blk in range(i_p, tl.cdiv(n_rows_q, BR), tl.num_programs(0)):
        _rope_block(
            q, yq, cos, sin, i_blk, n_rows_q, T, s_qb, s_qt, s_qh, s_cb, s_ct, H, K, R, BR, BH, BK, CT, BACKWARD
        )
    for i_blk in range(i_p, tl.cdiv(n_rows_k, BR), tl.num_programs(0)):
        _rope_block(
            k, yk, cos, sin, i_blk, n_rows_k, T, s_kb, s_kt, s_kh, s_cb, s_ct, HKV, K, R, BR, BH, BK, CT, BACKWARD
        )


def _rope_meta(shape: dict) -> dict:
    return {"BH": next_pow2(shape["R"] // 2), "BK": min(128, next_pow2(shape["K"]))}


def _rope_grid(meta: dict) -> tuple[int]:
    return grid_1d(cdiv(max(meta["n_rows_q"], meta["n_rows_k"]), meta["BR"]))


def _rope_rows(shape: dict) -> dict:
    return {"n_rows_q": shape["T"] * shape["H"], "n_rows_k": shape["T"] * shape["HKV"]}


KERNEL_LAUNCHES = {
    "_rope_kernel": {
        "configs": ROPE_CONFIGS,
        "meta": _rope_meta,
        "grid": _rope_grid,
        "runtime": _rope_rows,
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
        n_rows_q=B * T * H,
        n_rows_k=B * T * k.shape[2],
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
        **_rope_meta({"K": K, "R": R}),
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
