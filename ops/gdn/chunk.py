"""Chunked gated delta rule on our Triton kernels: orchestration, autograd Function, public API.

Stages (chunk = 64 tokens; see each module): l2norm (optional) -> solve (gate, cumsum,
Ai = (I + A)^-1) -> wy (w, Ai diag(beta)) -> state (sequential over chunks; u = Ai beta v) -> output. The
backward recomputes w (one cheap parallel pass) but keeps the forward's per-chunk states h and
v_new: recomputing them is a second sequential pass (its share of fwd+bwd: docs/ops.md, gdn), while keeping
them costs T * HV * (K + 4V) bytes per layer between forward and backward at bf16 (h in the input
dtype, v_new in fp32; 256 + 256 MiB at T=16384, HV=32, K=V=128, about twice the q/k/v inputs).
Then output_bwd_dv -> state_bwd (reverse) -> output_bwd -> wy_bwd -> the q/k epilogue. Every
gradient is written by exactly one program (no atomics), so results are bitwise reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..varlen import host_offsets, host_values
from .l2norm import gdn_l2norm_fwd, gdn_qk_bwd
from .launch import MAX_KV, ChunkPlan, make_plan
from .output import gdn_output_bwd, gdn_output_bwd_dv, gdn_output_fwd
from .reference import check_gdn_inputs
from .solve import gdn_solve_fwd
from .state import gdn_state_bwd, gdn_state_fwd
from .wy import gdn_wy_bwd, gdn_wy_fwd


@dataclass(frozen=True)
class GdnOptions:
    scale: float
    output_final_state: bool
    use_qk_l2norm_in_kernel: bool
    plan: ChunkPlan


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, gate, initial_state, opts: GdnOptions):
    """Forward stages. Returns o [B, T, HV, V], final state [N, HV, K, V] fp32 or None, and what the
    backward needs besides the inputs: (rstd_q, rstd_k, gc, Ai, h, vn)."""
    plan = opts.plan
    rq = rk = None
    if opts.use_qk_l2norm_in_kernel:
        rq, rk = gdn_l2norm_fwd(q, k)
    gc, Ai = gdn_solve_fwd(k, rk, beta, g, gate, plan)
    w, AiB = gdn_wy_fwd(k, rk, beta, gc, Ai, plan, store_aib=True)
    h, vn, ht = gdn_state_fwd(k, rk, v, w, AiB, gc, initial_state, opts.output_final_state, plan)
    del w, AiB
    o = gdn_output_fwd(q, rq, k, rk, gc, h, vn, opts.scale, plan)
    return o, ht, (rq, rk, gc, Ai, h, vn)


def chunk_gated_delta_rule_bwd(
    q, k, v, beta, gc, Ai, h, vn, rq, rk, gate, g_dtype, initial_state, do, dht, opts: GdnOptions
):
    """Backward stages, given the forward's h [NT, HV, K, V] and vn [B, T, HV, V]. Returns dq, dk
    [B, T, H, K], dv [B, T, HV, V], dbeta [B, T, HV], dg (or da) [B, T, HV], dh0 [N, HV, K, V] fp32
    or None, dA_log_tok [B, T, HV] fp32 or None."""
    plan = opts.plan
    w, _ = gdn_wy_fwd(k, rk, beta, gc, Ai, plan, store_aib=False)
    dvl = gdn_output_bwd_dv(q, rq, k, rk, gc, do, opts.scale, plan)
    dh, dh0, dvn = gdn_state_bwd(q, rq, k, rk, w, gc, dht, do, dvl, opts.scale, initial_state is not None, plan)
    del w, dvl
    dq_hv, dk_hv, dw, dgam, dgl = gdn_output_bwd(q, rq, k, rk, gc, h, dh, vn, dvn, do, opts.scale, plan)
    del dh
    dk_hv, dv, dbeta, dg, dA_log_tok = gdn_wy_bwd(
        k, rk, v, beta, gc, Ai, dw, dvn, dk_hv, dgam, dgl, gate, g_dtype, plan
    )
    dq, dk = gdn_qk_bwd(dq_hv, dk_hv, q, k, rq, rk)
    return dq, dk, dv, dbeta, dg, dh0, dA_log_tok


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    """Inputs: q, k, v, g (or None), beta, a, A_log, dt_bias (or None), initial_state (or None), opts."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, a, A_log, dt_bias, initial_state, opts: GdnOptions):
        gate = (a, A_log, dt_bias) if g is None else None
        o, ht, (rq, rk, gc, Ai, h, vn) = chunk_gated_delta_rule_fwd(q, k, v, g, beta, gate, initial_state, opts)
        ctx.save_for_backward(q, k, v, beta, gc, Ai, h, vn, rq, rk, a, A_log, dt_bias, initial_state)
        ctx.g_dtype = g.dtype if g is not None else None
        ctx.opts = opts
        ctx.set_materialize_grads(False)  # an unused final state costs no zero-filled gradient
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, beta, gc, Ai, h, vn, rq, rk, a, A_log, dt_bias, initial_state = ctx.saved_tensors
        opts = ctx.opts
        gate = (a, A_log, dt_bias) if a is not None else None
        do = torch.zeros_like(v) if do is None else do.contiguous()
        # The gate path keeps da in fp32 until ddt_bias is reduced from it.
        g_dtype = torch.float32 if gate is not None else ctx.g_dtype
        dq, dk, dv, dbeta, dg, dh0, dA_log_tok = chunk_gated_delta_rule_bwd(
            q,
            k,
            v,
            beta,
            gc,
            Ai,
            h,
            vn,
            rq,
            rk,
            gate,
            g_dtype,
            initial_state,
            do,
            None if dht is None else dht.contiguous(),
            opts,
        )
        if dh0 is not None:
            dh0 = dh0.to(initial_state.dtype)
        if gate is None:
            return dq, dk, dv, dg, dbeta, None, None, None, dh0, None
        # Per-token contributions reduced here (deterministic, no atomics).
        dA_log = dA_log_tok.sum((0, 1)).to(A_log.dtype)
        ddt_bias = None if dt_bias is None else dg.sum((0, 1)).to(dt_bias.dtype)
        return dq, dk, dv, None, dbeta, dg.to(a.dtype), dA_log, ddt_bias, dh0, None


def chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    *,
    a=None,
    A_log=None,
    dt_bias=None,
):
    """Gated delta rule, chunked (64 tokens), forward and backward on our Triton kernels.

    Per value head, with state S [K, V]: S <- S exp(g_t); S <- S + k_t beta_t (v_t - S^T k_t)^T;
    o_t = S^T (scale q_t). Same arguments and returns as `chunk_gated_delta_rule_ref`, plus the
    optional in-kernel gate.

    Args:
        q, k: [B, T, H, K] queries and keys (bf16, fp16 or fp32; K <= 128).
        v: [B, T, HV, V] values, same dtype; HV a multiple of H (value head j reads q/k head
            j // (HV // H); q/k are never repeated in memory).
        g: [B, T, HV] log-decay per token, any float dtype; pass None to compute it in-kernel
            from `a`, `A_log`, `dt_bias`.
        beta: [B, T, HV] delta-rule step size, any float dtype.
        scale: query scale, default K ** -0.5.
        initial_state: optional [N, HV, K, V] state per sequence (gets a gradient).
        output_final_state: also return the fp32 state after each sequence's last token.
        use_qk_l2norm_in_kernel: l2-normalise q and k over K first (eps 1e-6).
        cu_seqlens: optional [N+1] int32/int64 offsets of packed sequences (B == 1), any lengths.
        cu_seqlens_cpu: optional host copy of cu_seqlens (`ops/varlen.py`): no offsets are then read
            back from the device; without it cu_seqlens is read once.
        a: keyword-only, [B, T, HV] gate input when g is None: g = -exp(A_log) * softplus(a + dt_bias).
        A_log: keyword-only, [HV] (gets a gradient). dt_bias: keyword-only, [HV] or None (gets a gradient).
    Returns:
        o: [B, T, HV, V] in q's dtype; final_state: [N, HV, K, V] fp32, or None.
    Raises:
        ValueError: bad shapes or dtypes, K > 128, both or neither of g / a, bad cu_seqlens;
            raised before any kernel launch.
    """
    if (g is None) == (a is None):
        raise ValueError("pass exactly one of g (log-decay) or a (with A_log, dt_bias) for the in-kernel gate")
    B, T = q.shape[:2] if q.dim() == 4 else (0, 0)
    cu_seqlens_cpu = host_offsets(cu_seqlens, cu_seqlens_cpu)
    check_gdn_inputs(q, k, v, g if g is not None else a, beta, initial_state, cu_seqlens, cu_seqlens_cpu)
    bounds = None if cu_seqlens is None else host_values(cu_seqlens, cu_seqlens_cpu)
    HV, K = v.shape[2], q.shape[3]
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q, k, v must be bf16, fp16 or fp32 for the Triton kernels, got {q.dtype}")
    if K > MAX_KV:
        raise ValueError(f"head dim K={K} > {MAX_KV} is not supported by the Triton kernels")
    if a is not None:
        if A_log is None or A_log.shape != (HV,):
            raise ValueError(
                f"in-kernel gate needs A_log of shape [HV] = [{HV}], got "
                f"{None if A_log is None else tuple(A_log.shape)}"
            )
        if dt_bias is not None and dt_bias.shape != (HV,):
            raise ValueError(f"dt_bias must be [HV] = [{HV}], got {tuple(dt_bias.shape)}")
    elif A_log is not None or dt_bias is not None:
        raise ValueError("A_log / dt_bias are only used with the in-kernel gate (g=None, a=...)")
    tensors = [t for t in (q, k, v, g, beta, a, A_log, dt_bias, initial_state, cu_seqlens) if t is not None]
    if len({t.device for t in tensors}) > 1:
        raise ValueError(f"all inputs must be on one device, got {sorted({str(t.device) for t in tensors})}")
    opts = GdnOptions(
        scale=K**-0.5 if scale is None else float(scale),
        output_final_state=bool(output_final_state),
        use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
        plan=make_plan(bounds, B, T, q.device),
    )
    q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
    g = None if g is None else g.contiguous()
    a = None if a is None else a.contiguous()
    initial_state = None if initial_state is None else initial_state.contiguous()
    return ChunkGatedDeltaRuleFunction.apply(q, k, v, g, beta, a, A_log, dt_bias, initial_state, opts)
