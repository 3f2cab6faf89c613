"""Triton path of the log-prob + entropy head: the logits tile lives only in registers.

Forward: one kernel computes [BM tokens, BV vocab] logits tiles (fp32 accumulation from the input
dtype), folds them into per-token online stats over one split of the vocabulary and writes the
split's (max, sum-exp, shifted entropy sum) plus the label logit; a few [S, N] torch ops merge the
splits (`chunked.merge_stats`). Backward: per vocab chunk one kernel recomputes the logits tiles and
writes d_logits in the input dtype; the two GEMMs (d_weight rows of the chunk, d_hidden) are torch
matmuls through the shared loop in `chunked.backward_over_vocab`.

Ascend rules: power-of-two tiles of at most 128, 1-D grids <= 65535 with a grid-stride loop over
work items, no atomics (every output element has exactly one writer), no tl.trans (the weight tile
is loaded directly as [BK, BV]), guards on constexprs only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.launch import grid_1d, interpreting, launch
from .chunked import LogprobCall, backward_over_vocab, finish_stats, merge_stats

FWD_BM, FWD_BV, FWD_BK = 128, 128, 64
BWD_BM, BWD_BV, BWD_BK = 128, 128, 64
# GROUP_M token tiles walk the vocabulary together so their hidden tiles stay in L2 while the
# weight blocks stream through it once per group.
GROUP_M = 8
# Forward work items (token tile x vocab split) to aim for: ~15 waves of 132 SMs keeps the tail
# short, while a split still spans ~100 vocab blocks of the 248k vocabulary at N=16k.
FWD_TARGET_ITEMS = 2048
# 8 warps: the [128, 128] fp32 tile plus the softmax epilogue take ~230-255 registers a thread
# without spilling (ptxas, sm_90a); 4 warps spill.
FWD_CONFIGS = [{"num_warps": 8, "num_stages": 3}, {"num_warps": 8, "num_stages": 4}]
BWD_CONFIGS = [{"num_warps": 8, "num_stages": 3}, {"num_warps": 8, "num_stages": 4}]
# Documented largest shapes for the static rule check: 1M packed tokens, D 8192, a 256k vocabulary.
MAX_SHAPES = ({"N": 1 << 20, "D": 8192, "VOCAB": 1 << 18},)


@triton.jit
def _grouped_tile(i_w, num_m, num_n, GROUP_M: tl.constexpr):
    """Work item -> (token tile, column tile): GROUP_M token tiles share each column tile in turn."""
    per_group = GROUP_M * num_n
    first_m = (i_w // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (i_w % per_group) % size_m, (i_w % per_group) // size_m


@triton.jit
def _logits_tile(
    h,
    w,
    o_m,
    o_v,
    D,
    stride_h,
    stride_w,
    BM: tl.constexpr,
    BV: tl.constexpr,
    BK: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """[BM, BV] fp32 tile of h[o_m] @ w[o_v].T; o_m / o_v are already clamped in range.

    DOT_PRECISION "upcast" casts both tiles to fp32 first (exact for bf16: the interpreter's tl.dot
    multiplies bf16 bit patterns, triton-lang/triton#11584); otherwise it is tl.dot's input_precision.
    """
    o_k = tl.arange(0, BK)
    p_h = h + o_m.to(tl.int64)[:, None] * stride_h + o_k[None, :]
    p_w = w + o_v.to(tl.int64)[None, :] * stride_w + o_k[:, None]
    b_acc = tl.zeros([BM, BV], dtype=tl.float32)
    for k0 in range(0, D, BK):
        if EVEN_D:
            b_h = tl.load(p_h)
            b_w = tl.load(p_w)
        else:
            m_k = (k0 + o_k) < D
            b_h = tl.load(p_h, mask=m_k[None, :], other=0.0)
            b_w = tl.load(p_w, mask=m_k[:, None], other=0.0)
        if DOT_PRECISION == "upcast":
            b_acc = tl.dot(b_h.to(tl.float32), b_w.to(tl.float32), b_acc, input_precision="ieee")
        else:
            b_acc = tl.dot(b_h, b_w, b_acc, input_precision=DOT_PRECISION)
        p_h += BK
        p_w += BK
    return b_acc


@triton.jit
def _logprob_fwd_kernel(
    h,
    w,
    labels,
    inv_t,
    m_part,
    s_part,
    t_part,
    z_label,
    N,
    V,
    D,
    num_splits,
    blocks_per_split,
    stride_h,
    stride_w,
    BM: tl.constexpr,
    BV: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    ENTROPY: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One work item: BM tokens x one vocab split of `blocks_per_split` blocks of BV columns.

    Streams the split's blocks through an online log-sum-exp and stores the split's per-token
    (max, sum exp(z - max), sum exp(z - max) * (z - max)) at [split, token], and z[label] for tokens
    whose label lies in the split. Grid: grid_1d(items), programs stride over items.
    """
    i_p = tl.program_id(0)
    n_p = tl.num_programs(0)
    num_m = tl.cdiv(N, BM)
    for i_w in range(i_p, num_m * num_splits, n_p):
        i_m, i_s = _grouped_tile(i_w, num_m, num_splits, GROUP_M)
        o_m = i_m * BM + tl.arange(0, BM)
        m_m = o_m < N
        o_m = tl.minimum(o_m, N - 1)  # tail rows reload the last token and are never stored
        b_label = tl.load(labels + o_m)
        b_inv_t = tl.load(inv_t + o_m)
        v_lo = i_s * blocks_per_split * BV
        v_hi = tl.minimum(v_lo + blocks_per_split * BV, V)
        b_max = tl.full([BM], float("-inf"), dtype=tl.float32)
        b_sum = tl.zeros([BM], dtype=tl.float32)
        b_ent = tl.zeros([BM], dtype=tl.float32)
        b_zl = tl.zeros([BM], dtype=tl.float32)
        for v0 in range(v_lo, v_hi, BV):
            o_v = v0 + tl.arange(0, BV)
            m_v = o_v < V
            b_acc = _logits_tile(
                h, w, o_m, tl.minimum(o_v, V - 1), D, stride_h, stride_w, BM, BV, BK, EVEN_D, DOT_PRECISION
            )
            b_z = tl.where(m_v[None, :], b_acc * b_inv_t[:, None], float("-inf"))
            b_zl += tl.sum(tl.where(o_v[None, :] == b_label[:, None], b_z, 0.0), 1)
            b_new = tl.maximum(b_max, tl.max(b_z, 1))
            b_alpha = tl.exp(b_max - b_new)
            b_zs = b_z - b_new[:, None]
            b_e = tl.exp(b_zs)
            if ENTROPY:
                # -inf identity: before the first block max - new is -inf and sum is 0; masked
                # columns have zs = -inf and e = 0; select before multiplying so no nan appears
                b_shift = tl.where(b_sum > 0, b_max - b_new, 0.0) * b_sum
                b_ent = b_alpha * (b_ent + b_shift) + tl.sum(b_e * tl.where(m_v[None, :], b_zs, 0.0), 1)
            b_sum = b_alpha * b_sum + tl.sum(b_e, 1)
            b_max = b_new
        o_part = i_s * N + o_m
        tl.store(m_part + o_part, b_max, mask=m_m)
        tl.store(s_part + o_part, b_sum, mask=m_m)
        if ENTROPY:
            tl.store(t_part + o_part, b_ent, mask=m_m)
        tl.store(z_label + o_m, b_zl, mask=m_m & (b_label >= v_lo) & (b_label < v_hi))


@triton.jit
def _logprob_bwd_dlogits_kernel(
    h,
    w,
    labels,
    inv_t,
    lse,
    ent,
    g_lp,
    g_ent,
    dz,
    N,
    V,
    D,
    v_lo,
    width,
    stride_h,
    stride_w,
    stride_dz,
    BM: tl.constexpr,
    BV: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_GLP: tl.constexpr,
    HAS_GENT: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One tile: BM tokens x BV columns of the chunk [v_lo, v_lo + width).

    Recomputes z = h @ w.T / T, then dz = (g_lp * (onehot - p) - g_ent * p * (log p + H)) / T with
    p = exp(z - lse), stored in dz's dtype at dz[token, col - v_lo]. Grid: grid_1d(tiles).
    """
    i_p = tl.program_id(0)
    n_p = tl.num_programs(0)
    num_m = tl.cdiv(N, BM)
    num_v = tl.cdiv(width, BV)
    for i_w in range(i_p, num_m * num_v, n_p):
        i_m, i_v = _grouped_tile(i_w, num_m, num_v, GROUP_M)
        o_m = i_m * BM + tl.arange(0, BM)
        m_m = o_m < N
        o_m = tl.minimum(o_m, N - 1)
        o_c = i_v * BV + tl.arange(0, BV)
        m_c = o_c < width
        o_v = tl.minimum(v_lo + o_c, V - 1)
        b_acc = _logits_tile(h, w, o_m, o_v, D, stride_h, stride_w, BM, BV, BK, EVEN_D, DOT_PRECISION)
        b_inv_t = tl.load(inv_t + o_m)
        b_logp = b_acc * b_inv_t[:, None] - tl.load(lse + o_m)[:, None]
        b_p = tl.exp(b_logp)
        if HAS_GENT:
            b_coef = tl.load(g_ent + o_m)[:, None] * (b_logp + tl.load(ent + o_m)[:, None])
            if HAS_GLP:
                b_coef += tl.load(g_lp + o_m)[:, None]
        else:
            b_coef = tl.zeros([BM, BV], dtype=tl.float32) + tl.load(g_lp + o_m)[:, None]
        b_dz = -b_p * b_coef
        if HAS_GLP:
            b_hit = (v_lo + o_c)[None, :] == tl.load(labels + o_m)[:, None]
            b_dz += tl.where(b_hit, tl.load(g_lp + o_m)[:, None], 0.0)
        b_dz = b_dz * b_inv_t[:, None]
        p_dz = dz + o_m.to(tl.int64)[:, None] * stride_dz + o_c[None, :]
        tl.store(p_dz, b_dz.to(dz.dtype.element_ty), mask=m_m[:, None] & m_c[None, :])


def _fwd_plan(n: int, vocab: int) -> tuple[int, int, int]:
    """(token tiles, vocab splits, blocks per split): about FWD_TARGET_ITEMS items, no empty split."""
    num_m, num_vb = max(triton.cdiv(n, FWD_BM), 1), triton.cdiv(vocab, FWD_BV)
    blocks_per_split = triton.cdiv(num_vb, max(1, triton.cdiv(FWD_TARGET_ITEMS, num_m)))
    return num_m, triton.cdiv(num_vb, blocks_per_split), blocks_per_split


def _fwd_runtime(shape: dict) -> dict:
    num_m, num_splits, _ = _fwd_plan(shape["N"], shape["VOCAB"])
    return {"n_tiles": num_m * num_splits}


def _bwd_runtime(shape: dict) -> dict:
    return {"n_tiles": triton.cdiv(shape["N"], BWD_BM) * triton.cdiv(65536, BWD_BV)}


def _grid(meta: dict) -> tuple[int]:
    return grid_1d(meta["n_tiles"])


KERNEL_LAUNCHES = {
    "_logprob_fwd_kernel": {
        "configs": FWD_CONFIGS,
        "meta": lambda shape: {"BM": FWD_BM, "BV": FWD_BV, "BK": FWD_BK, "GROUP_M": GROUP_M},
        "grid": _grid,
        "runtime": _fwd_runtime,
        "max_shapes": MAX_SHAPES,
    },
    "_logprob_bwd_dlogits_kernel": {
        "configs": BWD_CONFIGS,
        "meta": lambda shape: {"BM": BWD_BM, "BV": BWD_BV, "BK": BWD_BK, "GROUP_M": GROUP_M},
        "grid": _grid,
        "runtime": _bwd_runtime,
        "max_shapes": MAX_SHAPES,
    },
}


def _dot_precision(dtype: torch.dtype) -> str:
    if interpreting() and dtype == torch.bfloat16:
        return "upcast"
    # fp32 inputs must not silently drop to TF32 (1e-3 relative): the fp32 tolerance is 2e-5
    return "ieee" if dtype == torch.float32 else "tf32"


def logprob_fwd(hidden, weight, labels, inv_t, entropy: bool):
    """[N, D], [VOCAB, D], [N] int64, [N] fp32 -> (log_prob [N], entropy [N] | None, lse [N]), fp32."""
    n, d = hidden.shape
    vocab = weight.shape[0]
    num_m, num_splits, blocks_per_split = _fwd_plan(n, vocab)
    m_part = torch.empty((num_splits, n), dtype=torch.float32, device=hidden.device)
    s_part = torch.empty_like(m_part)
    t_part = torch.empty_like(m_part) if entropy else None
    z_label = torch.empty(n, dtype=torch.float32, device=hidden.device)
    if n > 0:
        launch(
            _logprob_fwd_kernel, FWD_CONFIGS, ["D", "ENTROPY"], grid_1d(num_m * num_splits),
            h=hidden, w=weight, labels=labels, inv_t=inv_t, m_part=m_part, s_part=s_part,
            t_part=s_part if t_part is None else t_part, z_label=z_label, N=n, V=vocab, D=d,
            num_splits=num_splits, blocks_per_split=blocks_per_split, stride_h=hidden.stride(0),
            stride_w=weight.stride(0), BM=FWD_BM, BV=FWD_BV, BK=FWD_BK, GROUP_M=GROUP_M, ENTROPY=entropy,
            EVEN_D=d % FWD_BK == 0, DOT_PRECISION=_dot_precision(hidden.dtype),
        )  # fmt: skip
    m, s, t = merge_stats(m_part, s_part, t_part)
    return finish_stats(m, s, t, z_label)


def logprob_bwd_dlogits(hidden, weight, labels, inv_t, lse, ent, g_lp, g_ent, v_lo, width, out):
    """Chunk [v_lo, v_lo + width): writes d_logits [N, width] into out[:, :width] (out: [N, >=width]) and returns that view."""
    n, d = hidden.shape
    num_tiles = triton.cdiv(n, BWD_BM) * triton.cdiv(width, BWD_BV)
    dz = out[:, :width]
    if num_tiles > 0:
        launch(
            _logprob_bwd_dlogits_kernel, BWD_CONFIGS, ["D", "HAS_GLP", "HAS_GENT"], grid_1d(num_tiles),
            h=hidden, w=weight, labels=labels, inv_t=inv_t, lse=lse, ent=lse if ent is None else ent,
            g_lp=lse if g_lp is None else g_lp, g_ent=lse if g_ent is None else g_ent, dz=dz, N=n,
            V=weight.shape[0], D=d, v_lo=v_lo, width=width, stride_h=hidden.stride(0),
            stride_w=weight.stride(0), stride_dz=dz.stride(0), BM=BWD_BM, BV=BWD_BV, BK=BWD_BK,
            GROUP_M=GROUP_M, HAS_GLP=g_lp is not None, HAS_GENT=g_ent is not None, EVEN_D=d % BWD_BK == 0,
            DOT_PRECISION=_dot_precision(hidden.dtype),
        )  # fmt: skip
    return dz


class LogprobFusedFunction(torch.autograd.Function):
    """Triton log-prob + entropy; backward recomputes logits tiles per vocab chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, inv_t, call: LogprobCall):
        ctx.set_materialize_grads(False)
        log_prob, entropy, lse = logprob_fwd(hidden, weight, labels, inv_t, call.calculate_entropy)
        ctx.save_for_backward(hidden, weight, labels, inv_t, lse, entropy)
        ctx.call = call
        if entropy is not None and not call.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        dh, dw = fused_backward(*ctx.saved_tensors, g_lp, g_ent, ctx.call, *ctx.needs_input_grad[:2])
        return dh, dw, None, None, None


def fused_backward(hidden, weight, labels, inv_t, lse, entropy, g_lp, g_ent, call: LogprobCall, need_dh, need_dw):
    """(d_hidden, d_weight) of the Triton head from its forward's lse / entropy (fp32), the logits tiles
    recomputed per vocab chunk (also exact mode's head gradient on devices)."""
    if not call.entropy_grad:
        g_ent = None
    if g_lp is None and g_ent is None:
        return None, None
    g_lp = None if g_lp is None else g_lp.float().contiguous()
    g_ent = None if g_ent is None else g_ent.float().contiguous()
    step = call.options.vocab_chunk(hidden.shape[0])
    buf = torch.empty((hidden.shape[0], min(step, weight.shape[0])), dtype=hidden.dtype, device=hidden.device)

    def dlogits(v0, width):
        return logprob_bwd_dlogits(hidden, weight, labels, inv_t, lse, entropy, g_lp, g_ent, v0, width, buf)

    return backward_over_vocab(hidden, weight, need_dh, need_dw, step, dlogits)


def logprobs_and_entropy_fused(hidden, weight, labels, inv_t, call: LogprobCall):
    """Triton impl entry (validated inputs; inv_t: [N] fp32 1/T). Returns (log_prob, entropy | None), fp32."""
    if hidden.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"the triton logprob path takes fp16/bf16/fp32, got {hidden.dtype}; use impl='torch'")
    return LogprobFusedFunction.apply(hidden, weight, labels, inv_t, call)
