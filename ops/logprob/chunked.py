"""Chunked torch path of the log-prob + entropy head, and the pieces the Triton path shares.

Forward streams the vocabulary in chunks of columns with an online log-sum-exp per token:
running max m, s = sum exp(z - m) and the shifted entropy sum t = sum exp(z - m) * (z - m);
then lse = m + log s, entropy = log s - t / s, log_prob = z_label - lse. Keeping t shifted by
m (every term <= 0) avoids the cancellation of lse - E[z] when |logit| ~ 1e4, and makes
log_prob <= 0 and entropy >= 0 hold exactly in floating point.

Backward recomputes one [N, chunk] logits tile at a time:
d_z = g_lp * (onehot - p) - g_ent * p * (log p + H), times 1/T, and writes d_weight[chunk] in one
matmul (each vocab row sees all tokens at once) while d_hidden accumulates in fp32 across chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LogprobOptions:
    """Working-set knobs (the results do not depend on them beyond rounding).

    chunk_elems: the most elements of one [N, vocab-chunk] tile: fp32 logits in the torch path,
        d_logits (input dtype) in the Triton backward. The vocab chunk is the largest power of two
        with N * chunk <= chunk_elems, clamped to [128, 65536].
    """

    chunk_elems: int = 1 << 26

    def __post_init__(self):
        if self.chunk_elems < 1:
            raise ValueError(f"chunk_elems must be >= 1, got {self.chunk_elems}")

    def vocab_chunk(self, n_tokens: int) -> int:
        per_row = max(self.chunk_elems // max(n_tokens, 1), 1)
        return min(max(1 << (per_row.bit_length() - 1), 128), 65536)


@dataclass(frozen=True)
class LogprobCall:
    """What one call asks for; the one non-tensor input of the autograd Functions."""

    calculate_entropy: bool = True
    entropy_grad: bool = True
    options: LogprobOptions = field(default_factory=LogprobOptions)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def logits_chunk(hidden: torch.Tensor, weight_c: torch.Tensor, inv_t: torch.Tensor) -> torch.Tensor:
    """[N, D] x [C, D] -> [N, C] logits / T in the compute dtype (a fresh tensor we own).

    hidden / weight_c are already in the matmul dtype; half types on CUDA use the bf16/fp16 GEMM
    with an fp32 output (exact fp32 accumulation, no bf16 rounding of the logits); elsewhere the
    operands are upcast, which has the same numerics.
    """
    acc = compute_dtype(hidden.dtype)
    if hidden.device.type == "cuda" and hidden.dtype in (torch.float16, torch.bfloat16):
        z = torch.mm(hidden, weight_c.t(), out_dtype=torch.float32)
    else:
        z = torch.mm(hidden.to(acc), weight_c.to(acc).t())
    return z.mul_(inv_t.to(z.dtype)[:, None])


def finish_stats(m, s, t, z_label):
    """Per-token (max, sum-exp, shifted entropy sum, label logit) -> (log_prob, entropy | None, lse)."""
    log_s = torch.log(s)
    lse = m + log_s
    entropy = None if t is None else log_s - t / s
    return z_label - lse, entropy, lse


def merge_stats(m_part, s_part, t_part):
    """Combine [S, N] partial stats of disjoint vocab ranges into [N] stats (each range non-empty)."""
    m = m_part.max(0).values
    scale = torch.exp(m_part - m)
    s = (s_part * scale).sum(0)
    t = None if t_part is None else (scale * (t_part + (m_part - m) * s_part)).sum(0)
    return m, s, t


def _online_update(m, s, t, z):
    """Fold a [N, C] logits tile (overwritten) into the running stats; returns (m, s, t)."""
    m_new = torch.maximum(m, z.max(1).values)
    alpha = torch.exp(m - m_new)
    z.sub_(m_new[:, None])
    e = torch.exp(z)
    if t is not None:
        # the -inf identity: before the first tile m - m_new is -inf and s is 0 (select, then multiply)
        shift = torch.where(s > 0, m - m_new, torch.zeros_like(s)) * s
        t = alpha * (t + shift) + (e * z).sum(1)
    return m_new, alpha * s + e.sum(1), t


def chunked_forward(hidden, weight, labels, inv_t, entropy: bool, options: LogprobOptions):
    """Torch forward: returns (log_prob [N], entropy [N] | None, lse [N]) in the compute dtype."""
    n, vocab = hidden.shape[0], weight.shape[0]
    acc = compute_dtype(hidden.dtype)
    m = torch.full((n,), float("-inf"), dtype=acc, device=hidden.device)
    s = torch.zeros(n, dtype=acc, device=hidden.device)
    t = torch.zeros_like(s) if entropy else None
    z_label = torch.zeros_like(s)
    step = options.vocab_chunk(n)
    hid = hidden if hidden.device.type == "cuda" else hidden.to(acc)
    for v0 in range(0, vocab, step):
        z = logits_chunk(hid, weight[v0 : v0 + step], inv_t)
        width = z.shape[1]
        in_chunk = (labels >= v0) & (labels < v0 + width)
        col = (labels - v0).clamp(0, width - 1)
        z_label = torch.where(in_chunk, z.gather(1, col[:, None]).squeeze(1), z_label)
        m, s, t = _online_update(m, s, t, z)
    return finish_stats(m, s, t, z_label)


def torch_dlogits(hidden, weight_c, labels, v0, inv_t, lse, ent, g_lp, g_ent) -> torch.Tensor:
    """d loss / d logits_raw for one chunk: [N, C] in the compute dtype (fp32 / fp64).

    logits_raw = hidden @ weight_c.T; the 1/T of the temperature is already applied.
    """
    z = logits_chunk(hidden, weight_c, inv_t).sub_(lse[:, None])  # log p
    p = torch.exp(z)
    if g_ent is not None:
        coef = z.add_(ent[:, None]).mul_(g_ent[:, None])
        if g_lp is not None:
            coef.add_(g_lp[:, None])
    else:
        coef = g_lp[:, None]
    dz = p.mul_(coef).neg_()
    if g_lp is not None:
        width = dz.shape[1]
        in_chunk = (labels >= v0) & (labels < v0 + width)
        col = (labels - v0).clamp(0, width - 1)[:, None]
        dz.scatter_add_(1, col, torch.where(in_chunk, g_lp, torch.zeros_like(g_lp))[:, None])
    return dz.mul_(inv_t.to(dz.dtype)[:, None])


def backward_over_vocab(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    need_dh: bool,
    need_dw: bool,
    step: int,
    dlogits: Callable[[int, int], torch.Tensor],
):
    """Shared backward loop: d_hidden [N, D] and d_weight [VOCAB, D] in the input dtype (or None).

    dlogits(v0, width) returns the [N, width] d_logits of columns [v0, v0 + width), in the input
    dtype for half inputs (so the two matmuls run on the fast GEMM) and in the compute dtype
    otherwise. d_weight rows of a chunk see every token in one matmul (fp32 accumulation inside the
    GEMM, one rounding); d_hidden sums chunk products in fp32.
    """
    vocab = weight.shape[0]
    acc = compute_dtype(hidden.dtype)
    dh = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_dh else None
    dw = torch.empty_like(weight) if need_dw else None
    mm_dtype = hidden.dtype if hidden.dtype in (torch.float16, torch.bfloat16) else acc
    if hidden.device.type != "cuda":
        mm_dtype = acc  # CPU half GEMMs are slow and gain nothing here
    hid = hidden.to(mm_dtype)
    for v0 in range(0, vocab, step):
        width = min(step, vocab - v0)
        dz = dlogits(v0, width).to(mm_dtype)
        if need_dw and dw.dtype == mm_dtype:
            torch.mm(dz.t(), hid, out=dw[v0 : v0 + width])  # rows of dw are contiguous: no temporary
        elif need_dw:
            dw[v0 : v0 + width] = torch.mm(dz.t(), hid)
        if need_dh:
            dh += torch.mm(dz, weight[v0 : v0 + width].to(mm_dtype))
    return (None if dh is None else dh.to(hidden.dtype)), dw


class LogprobChunkedFunction(torch.autograd.Function):
    """Chunked torch log-prob + entropy; backward recomputes logits one vocab chunk at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, inv_t, call: LogprobCall):
        ctx.set_materialize_grads(False)
        log_prob, entropy, lse = chunked_forward(hidden, weight, labels, inv_t, call.calculate_entropy, call.options)
        ctx.save_for_backward(hidden, weight, labels, inv_t, lse, entropy)
        ctx.call = call
        log_prob = log_prob.float()
        if entropy is not None:
            entropy = entropy.float()
            if not call.entropy_grad:
                ctx.mark_non_differentiable(entropy)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        dh, dw = chunked_backward(*ctx.saved_tensors, g_lp, g_ent, ctx.call, *ctx.needs_input_grad[:2])
        return dh, dw, None, None, None


def chunked_backward(hidden, weight, labels, inv_t, lse, entropy, g_lp, g_ent, call: LogprobCall, need_dh, need_dw):
    """(d_hidden, d_weight) of the torch head from its forward's lse / entropy, one vocab chunk of logits
    recomputed at a time (also exact mode's head gradient on cpu)."""
    if not call.entropy_grad:
        g_ent = None
    if g_lp is None and g_ent is None:
        return None, None
    acc = lse.dtype
    g_lp = None if g_lp is None else g_lp.to(acc)
    g_ent = None if g_ent is None else g_ent.to(acc)
    hid = hidden if hidden.device.type == "cuda" else hidden.to(acc)

    def dlogits(v0, width):
        w_c = weight[v0 : v0 + width]
        return torch_dlogits(hid, w_c, labels, v0, inv_t, lse, entropy, g_lp, g_ent)

    return backward_over_vocab(hidden, weight, need_dh, need_dw, call.options.vocab_chunk(hidden.shape[0]), dlogits)


def logprobs_and_entropy_chunked(hidden, weight, labels, inv_t, call: LogprobCall):
    """Torch impl entry (validated inputs; inv_t: [N] 1/T in the compute dtype).

    Returns (log_prob [N] fp32, entropy [N] fp32 | None)."""
    return LogprobChunkedFunction.apply(hidden, weight, labels, inv_t, call)
