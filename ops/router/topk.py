"""fp32 top-k softmax router: the gate GEMM in torch, then one Triton kernel per block of rows for
softmax, top-k and renormalisation (forward), and one for their backward.

Forward: logits = hidden @ gate_weight.T in fp32 (for bf16/fp16 operands on CUDA a 16-bit GEMM with
fp32 output: the products of 16-bit values are exact in fp32, so this is the fp32 GEMM of the same
values without an fp32 copy of hidden); the kernel writes topk_weight [N, TOPK] fp32 and topk_idx
[N, TOPK] int64. The experts are chosen by their logits (the order of the probabilities, without
the rounding of exp); on exact ties the lower expert id comes first (torch.topk leaves ties in an
unspecified order). Backward: d topk_weight (and d logits, from the load-balancing loss) -> d logits
through the renormalisation and the softmax in fp32, then the GEMM backward to fp32 accuracy in torch.
For bf16 operands the kernel writes d logits as its bf16 hi/lo split [N, 2E] and the backward is two
bf16 GEMMs with fp32 accumulation (`_split_gemms_bwd`): no fp32 d logits, no elementwise passes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..common.launch import cdiv, grid_1d, launch, next_pow2
from .reference import check_route_inputs, route_ref

MAX_EXPERTS = 512
MAX_TOPK = 16
# Rows per program: the first config is what the interpreter and deterministic mode run.
TOPK_FWD_CONFIGS = [
    {"BR": 4, "num_warps": 4},
    {"BR": 8, "num_warps": 4},
    {"BR": 16, "num_warps": 8},
    {"BR": 2, "num_warps": 2},
]
TOPK_BWD_CONFIGS = TOPK_FWD_CONFIGS


@triton.jit
def _router_probs(logits, o_r, m_r, o_e, E: tl.constexpr):
    """Rows o_r of logits [rows, E] fp32 with padding columns at -inf, exp(z - max) and its row sum."""
    m_e = o_e < E
    b_z = tl.load(logits + o_r[:, None] * E + o_e[None, :], mask=m_r[:, None] & m_e[None, :], other=0.0)
    b_z = tl.where(m_e[None, :], b_z, float("-inf"))
    b_m = tl.max(b_z, 1)
    b_x = tl.exp(b_z - b_m[:, None])
    return b_z, b_m, b_x, tl.sum(b_x, 1)


@triton.jit(do_not_specialize=["n_rows"])
def _router_topk_fwd_kernel(
    logits,
    weight,
    idx,
    n_rows,
    E: tl.constexpr,
    TOPK: tl.constexpr,
    BE: tl.constexpr,
    BK: tl.constexpr,
    BR: tl.constexpr,
    RENORM: tl.constexpr,
):
    """One program per block of BR rows (1-D grid, looping): softmax of logits [rows, E] fp32, its TOPK
    largest by iterative max (lowest id on ties), renormalised when RENORM -> weight [rows, TOPK] fp32,
    idx [rows, TOPK] int64."""
    i_p = tl.program_id(0)
    o_e = tl.arange(0, BE)
    o_k = tl.arange(0, BK)
    for i_blk in range(i_p, tl.cdiv(n_rows, BR), tl.num_programs(0)):
        o_r = (i_blk * BR + tl.arange(0, BR)).to(tl.int64)
        m_r = o_r < n_rows
        b_z, b_m, b_x, b_s = _router_probs(logits, o_r, m_r, o_e, E)
        b_w = tl.zeros([BR, BK], dtype=tl.float32)
        b_i = tl.zeros([BR, BK], dtype=tl.int32)
        for i_k in range(TOPK):
            b_v = tl.max(b_z, 1)
            b_j = tl.min(tl.where(b_z == b_v[:, None], o_e[None, :], BE), 1)
            # the probability of the chosen expert, as the softmax computes it: exp(z - max) / sum
            b_w = tl.where(o_k[None, :] == i_k, (tl.exp(b_v - b_m) / b_s)[:, None], b_w)
            b_i = tl.where(o_k[None, :] == i_k, b_j[:, None], b_i)
            b_z = tl.where(o_e[None, :] == b_j[:, None], float("-inf"), b_z)
        if RENORM:
            b_w = b_w / tl.sum(b_w, 1)[:, None]
        p = o_r[:, None] * TOPK + o_k[None, :]
        m = m_r[:, None] & (o_k < TOPK)[None, :]
        tl.store(weight + p, b_w, mask=m)
        tl.store(idx + p, b_i.to(tl.int64), mask=m)


@triton.jit
def _router_dz(logits, idx, dweight, o_r, m_r, o_e, E: tl.constexpr, TOPK: tl.constexpr, BE: tl.constexpr,
               BR: tl.constexpr, RENORM: tl.constexpr):  # fmt: skip
    """d logits [BR, BE] fp32 of rows o_r from d weight [rows, TOPK] through the renormalisation and
    the softmax (probabilities recomputed from logits).

    With p the softmax, G_e = dweight of expert e (0 when unchosen), sel_e = 1 when chosen, S = sum of
    the chosen p and A = sum_k dweight_k p_k: renormalised, dz = p / S * (G - sel * A / S) (the
    weights do not change when p is scaled, so the softmax term vanishes); raw, dz = p * (G - A)."""
    b_z, b_m, b_x, b_s = _router_probs(logits, o_r, m_r, o_e, E)
    b_p = b_x / b_s[:, None]
    b_g = tl.zeros([BR, BE], dtype=tl.float32)
    b_sel = tl.zeros([BR, BE], dtype=tl.float32)
    b_sum = tl.zeros([BR], dtype=tl.float32)
    b_a = tl.zeros([BR], dtype=tl.float32)
    for i_k in range(TOPK):
        b_j = tl.load(idx + o_r * TOPK + i_k, mask=m_r, other=0).to(tl.int32)
        b_dw = tl.load(dweight + o_r * TOPK + i_k, mask=m_r, other=0.0)
        b_hit = o_e[None, :] == b_j[:, None]
        b_pk = tl.sum(tl.where(b_hit, b_p, 0.0), 1)
        b_sum += b_pk
        b_a += b_dw * b_pk
        b_g += tl.where(b_hit, b_dw[:, None], 0.0)
        b_sel += tl.where(b_hit, 1.0, 0.0)
    if RENORM:
        b_sum = tl.where(m_r, b_sum, 1.0)
        b_dz = b_p / b_sum[:, None] * (b_g - b_sel * (b_a / b_sum)[:, None])
    else:
        b_dz = b_p * (b_g - b_a[:, None])
    return b_dz


@triton.jit(do_not_specialize=["n_rows"])
def _router_topk_bwd_kernel(
    logits,
    idx,
    dweight,
    dlogits_in,
    dlogits,
    n_rows,
    E: tl.constexpr,
    TOPK: tl.constexpr,
    BE: tl.constexpr,
    BR: tl.constexpr,
    RENORM: tl.constexpr,
    HAS_DWEIGHT: tl.constexpr,
    HAS_DLOGITS: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """One program per block of BR rows (1-D grid, looping): d logits dz [rows, E] in fp32 from d weight
    [rows, TOPK] (when HAS_DWEIGHT; `_router_dz`) plus dlogits_in [rows, E] (when HAS_DLOGITS).

    Written as dlogits [rows, E] fp32, or with SPLIT as its bf16 split [rows, 2E]: hi = bf16(dz) in
    columns [0, E), lo = bf16(dz - hi) (dz - hi is exact in fp32) in [E, 2E); hi + lo = dz to
    ~2^-17 |dz| (rounding to nearest; the interpreter truncates: ~2^-14), the operand of the backward
    GEMMs on bf16 tensor cores (one pass, no fp32 dz)."""
    i_p = tl.program_id(0)
    o_e = tl.arange(0, BE)
    for i_blk in range(i_p, tl.cdiv(n_rows, BR), tl.num_programs(0)):
        o_r = (i_blk * BR + tl.arange(0, BR)).to(tl.int64)
        m_r = o_r < n_rows
        p = o_r[:, None] * E + o_e[None, :]
        m = m_r[:, None] & (o_e < E)[None, :]
        if HAS_DWEIGHT:
            b_dz = _router_dz(logits, idx, dweight, o_r, m_r, o_e, E, TOPK, BE, BR, RENORM)
            if HAS_DLOGITS:
                b_dz += tl.load(dlogits_in + p, mask=m, other=0.0)
        else:
            b_dz = tl.load(dlogits_in + p, mask=m, other=0.0)
        if SPLIT:
            b_hi = b_dz.to(tl.bfloat16)
            b_lo = (b_dz - b_hi.to(tl.float32)).to(tl.bfloat16)
            p_hi = dlogits + o_r[:, None] * (2 * E) + o_e[None, :]
            tl.store(p_hi, b_hi, mask=m)
            tl.store(p_hi + E, b_lo, mask=m)
        else:
            tl.store(dlogits + p, b_dz, mask=m)


def _topk_meta(shape: dict) -> dict:
    return {"BE": next_pow2(shape["E"]), "BK": next_pow2(shape["TOPK"], lo=1)}


def _topk_grid(meta: dict) -> tuple[int]:
    return grid_1d(cdiv(meta["n_rows"], meta["BR"]))


def _max_rows(shape: dict) -> dict:
    return {"n_rows": shape["N"]}


_MAX_SHAPES = ({"N": 1 << 20, "E": MAX_EXPERTS, "TOPK": MAX_TOPK}, {"N": 16384, "E": 256, "TOPK": 8})
KERNEL_LAUNCHES = {
    name: {"configs": configs, "meta": _topk_meta, "grid": _topk_grid, "runtime": _max_rows, "max_shapes": _MAX_SHAPES}
    for name, configs in (
        ("_router_topk_fwd_kernel", TOPK_FWD_CONFIGS),
        ("_router_topk_bwd_kernel", TOPK_BWD_CONFIGS),
    )
}


def router_topk_fwd(logits: torch.Tensor, top_k: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] fp32 contiguous -> topk_weight [N, TOPK] fp32, topk_idx [N, TOPK] int64."""
    N, E = logits.shape
    weight = torch.empty(N, top_k, dtype=torch.float32, device=logits.device)
    idx = torch.empty(N, top_k, dtype=torch.int64, device=logits.device)
    if N > 0:
        launch(
            _router_topk_fwd_kernel,
            TOPK_FWD_CONFIGS,
            ["E", "TOPK"],
            _topk_grid,
            logits=logits,
            weight=weight,
            idx=idx,
            n_rows=N,
            E=E,
            TOPK=top_k,
            RENORM=renorm,
            **_topk_meta({"E": E, "TOPK": top_k}),
        )
    return weight, idx


def router_topk_bwd(
    logits: torch.Tensor,
    idx: torch.Tensor,
    dweight: torch.Tensor | None,
    dlogits: torch.Tensor | None,
    renorm: bool,
    split: bool = False,
) -> torch.Tensor:
    """logits [N, E] fp32, idx [N, TOPK], dweight [N, TOPK] and dlogits [N, E] (None: zero; not both)
    -> d logits [N, E] fp32, or with split its bf16 hi/lo split [N, 2E] (`_router_topk_bwd_kernel`)."""
    N, E = logits.shape
    if dweight is None and dlogits is None:
        raise ValueError("router_topk_bwd needs dweight or dlogits")
    if split:
        out = torch.empty(N, 2 * E, dtype=torch.bfloat16, device=logits.device)
    elif dweight is None:
        return dlogits.float().contiguous()
    else:
        out = torch.empty_like(logits)
    if N > 0:
        launch(
            _router_topk_bwd_kernel,
            TOPK_BWD_CONFIGS,
            ["E", "TOPK", "HAS_DWEIGHT", "HAS_DLOGITS", "SPLIT"],
            _topk_grid,
            logits=logits,
            idx=idx,
            dweight=logits if dweight is None else dweight.float().contiguous(),
            dlogits_in=logits if dlogits is None else dlogits.float().contiguous(),
            dlogits=out,
            n_rows=N,
            E=E,
            TOPK=idx.shape[1],
            RENORM=renorm,
            HAS_DWEIGHT=dweight is not None,
            HAS_DLOGITS=dlogits is not None,
            SPLIT=split,
            BE=next_pow2(E),
        )
    return out


@functools.cache
def _mm_takes_fp32_out(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch has a 16-bit CUDA mm with fp32 output (`torch.mm(..., out_dtype=)`, torch >= 2.8)."""
    try:
        torch.mm(torch.zeros(16, 16, dtype=dtype, device=device), torch.zeros(16, 16, dtype=dtype, device=device),
                 out_dtype=torch.float32)  # fmt: skip
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def _gate_logits(hidden: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """hidden [N, D] @ gate_weight[E, D].T in fp32 -> [N, E] fp32. Where the 16-bit mm with fp32 output
    exists (CUDA) it is the fp32 GEMM of the same values (16-bit products are exact in fp32, fp32
    accumulation) without an fp32 copy of hidden; elsewhere the operands are upcast."""
    sixteen = (torch.bfloat16, torch.float16)
    if (
        hidden.is_cuda
        and hidden.dtype in sixteen
        and gate_weight.dtype == hidden.dtype
        and _mm_takes_fp32_out(hidden.device, hidden.dtype)
    ):
        return torch.mm(hidden, gate_weight.t(), out_dtype=torch.float32)
    return F.linear(hidden.float(), gate_weight.float())


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] fp32 @ b [K, N] to fp32 accuracy, -> fp32 (the backward GEMMs of operands that are not
    both bf16). For a bf16 b, a = hi + lo in bf16 (exact to ~2^-17 |a|) and two bf16 GEMMs with fp32
    output (the products of bf16 values are exact in fp32); otherwise the fp32 GEMM on upcast b."""
    if b.dtype != torch.bfloat16:
        return a @ b.float()
    hi = a.to(torch.bfloat16)
    lo = (a - hi.float()).to(torch.bfloat16)
    if b.is_cuda and _mm_takes_fp32_out(b.device, b.dtype):
        return torch.mm(hi, b, out_dtype=torch.float32) + torch.mm(lo, b, out_dtype=torch.float32)
    return hi.float() @ b.float() + lo.float() @ b.float()


def _split_gemms_bwd(
    hilo: torch.Tensor, hidden: torch.Tensor, gate_weight: torch.Tensor, need_hidden: bool, need_weight: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The GEMM backward of bf16 hidden [N, D] and gate_weight [E, D] from the split d logits hilo
    [N, 2E] bf16 ([hi | lo], `router_topk_bwd(split=True)`), to fp32 accuracy on bf16 tensor cores:
    d hidden = hi @ W + lo @ W = hilo @ [W; W], one GEMM over K = 2E with fp32 accumulation and one
    rounding to bf16 (as every bf16 linear backward); d gate_weight = hi.T @ hidden + lo.T @ hidden,
    one GEMM of M = 2E (hidden read once) with fp32 output, halves summed in fp32, then rounded.
    Where the 16-bit mm with fp32 output is missing (CPU) the same products run upcast."""
    E = gate_weight.shape[0]
    fast = hilo.is_cuda and _mm_takes_fp32_out(hilo.device, hilo.dtype)
    dhidden = dgate = None
    if need_hidden:
        w2 = torch.cat([gate_weight, gate_weight])
        dhidden = torch.mm(hilo, w2) if fast else (hilo.float() @ w2.float()).to(hidden.dtype)
    if need_weight:
        g = torch.mm(hilo.t(), hidden, out_dtype=torch.float32) if fast else hilo.t().float() @ hidden.float()
        dgate = (g[:E] + g[E:]).to(gate_weight.dtype)
    return dhidden, dgate


@dataclass(frozen=True)
class _RouterOptions:
    top_k: int
    renorm: bool


class RouterFunction(torch.autograd.Function):
    """(hidden [N, D], gate_weight [E, D]) -> logits [N, E] fp32, topk_weight [N, TOPK] fp32,
    topk_idx [N, TOPK] int64. Saves hidden and gate_weight in their own dtypes (no fp32 copy of hidden),
    the fp32 logits and the ids."""

    @staticmethod
    def forward(ctx, hidden, gate_weight, opts: _RouterOptions):
        logits = _gate_logits(hidden, gate_weight)
        weight, idx = router_topk_fwd(logits, opts.top_k, opts.renorm)
        ctx.save_for_backward(hidden, gate_weight, logits, idx)
        ctx.opts = opts
        ctx.mark_non_differentiable(idx)
        # an unused output (the logits without a load-balancing loss) arrives as None, not as zeros
        ctx.set_materialize_grads(False)
        return logits, weight, idx

    @staticmethod
    def backward(ctx, dlogits, dweight, _didx):
        hidden, gate_weight, logits, idx = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        if (dlogits is None and dweight is None) or not (need_hidden or need_weight):
            return None, None, None
        if hidden.dtype == gate_weight.dtype == torch.bfloat16:
            hilo = router_topk_bwd(logits, idx, dweight, dlogits, ctx.opts.renorm, split=True)
            return (*_split_gemms_bwd(hilo, hidden, gate_weight, need_hidden, need_weight), None)
        dz = router_topk_bwd(logits, idx, dweight, dlogits, ctx.opts.renorm)
        dhidden = _mm_fp32(dz, gate_weight).to(hidden.dtype) if need_hidden else None
        dgate = _mm_fp32(dz.t(), hidden).to(gate_weight.dtype) if need_weight else None
        return dhidden, dgate, None


def route_triton(
    hidden: torch.Tensor,
    gate_weight: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`route_ref`'s contract (the dispatched `router` op) with the fp32 Triton kernel.

    Args:
        hidden: [N, D] token activations, any float dtype.
        gate_weight: [E, D] router weight, E <= 512.
        top_k: experts per token, 1 <= TOPK <= min(E, 16).
        norm_topk_prob: renormalise the TOPK probabilities to sum to 1 per token.
        dtype: fp32 runs the kernel; any other floating dtype (fp64 goldens, bf16 ablations) is the
            reference's own computation in that dtype, `route_ref`.
    Returns:
        router_logits [N, E], topk_weight [N, TOPK] in dtype; topk_idx [N, TOPK] int64 by descending
        probability, the lower expert id first on exact ties.
    Raises:
        ValueError: bad shapes, top_k out of range, non-float dtype, E > 512 or TOPK > 16 in fp32.
    """
    if dtype != torch.float32:
        return route_ref(hidden, gate_weight, top_k, norm_topk_prob, dtype=dtype)
    check_route_inputs(hidden, gate_weight, top_k, dtype)
    num_experts = gate_weight.shape[0]
    if num_experts > MAX_EXPERTS or top_k > MAX_TOPK:
        raise ValueError(
            f"the Triton router takes E <= {MAX_EXPERTS} and top_k <= {MAX_TOPK}, got E={num_experts}, "
            f"top_k={top_k} (use the torch router)"
        )
    opts = _RouterOptions(top_k=int(top_k), renorm=bool(norm_topk_prob))
    return RouterFunction.apply(hidden.contiguous(), gate_weight.contiguous(), opts)
