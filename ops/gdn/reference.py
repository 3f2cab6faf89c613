"""Plain PyTorch references of the gated delta rule (Qwen3.5 linear attention).

Per value head, with state S [K, V] and per-token gate g (log-decay), beta, key k, value v, query q:

    S   <- S * exp(g_t)
    u_t  = beta_t * (v_t - S^T k_t)
    S   <- S + k_t u_t^T
    o_t  = S^T (scale * q_t)

`recurrent_gated_delta_rule_ref` runs that loop token by token; `chunk_gated_delta_rule_ref`
computes the same thing 64 tokens at a time (WY form: one unit-lower-triangular solve per
chunk, then one state update per chunk), which is the algorithm the Triton kernels follow.
Both are dtype-generic: fp64 inputs give an fp64 golden; lower precisions compute in fp32.
"""

from __future__ import annotations

import torch

from ..varlen import check_cu_seqlens, seq_bounds

CHUNK_SIZE = 64


def check_gdn_inputs(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu=None) -> None:
    """Raise ValueError for shapes, dtypes or cu_seqlens that the gated delta rule cannot take."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, _ = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, HV, V] with B={B}, T={T}, got {tuple(v.shape)}")
    HV = v.shape[2]
    if HV % H != 0:
        raise ValueError(f"value heads HV={HV} must be a multiple of q/k heads H={H}")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (B, T, HV):
            raise ValueError(f"{name} must be [B, T, HV] = {(B, T, HV)}, got {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.is_floating_point():
        raise ValueError(f"q, k, v must be floating point, got {q.dtype}")
    num_seqs = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"varlen input (cu_seqlens) needs B == 1, got B={B}")
        check_cu_seqlens(cu_seqlens, T, cu_seqlens_cpu)
        num_seqs = cu_seqlens.numel() - 1
    if initial_state is not None:
        expected = (num_seqs, HV, q.shape[-1], v.shape[-1])
        if tuple(initial_state.shape) != expected:
            raise ValueError(f"initial_state must be [N, HV, K, V] = {expected}, got {tuple(initial_state.shape)}")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel):
    """Upcast, normalise, scale and repeat q/k heads to HV; returns tensors [B, T, HV, *]."""
    dtype = _compute_dtype(v)
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    group = v.shape[2] // q.shape[2]  # GVA: value head j reads q/k head j // group
    q = q.repeat_interleave(group, dim=2) * scale
    k = k.repeat_interleave(group, dim=2)
    return q, k, v, g, beta


def _run_per_sequence(
    step,
    q,
    k,
    v,
    g,
    beta,
    scale,
    initial_state,
    output_final_state,
    use_qk_l2norm_in_kernel,
    cu_seqlens,
    cu_seqlens_cpu,
):
    """Shared driver: validate, prepare, and call `step(q, k, v, g, beta, S0)` per sequence,
    where each tensor is [T_seq, HV, *] and S0 is [HV, K, V]; `step` returns (o, S)."""
    check_gdn_inputs(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else scale
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    o = torch.zeros_like(v)
    states = []
    sequences = [(b, s, e) for b in range(B) for s, e in seq_bounds(cu_seqlens, T, cu_seqlens_cpu)]
    for n, (b, s, e) in enumerate(sequences):
        if initial_state is not None:
            S0 = initial_state[n].to(v.dtype)
        else:
            S0 = v.new_zeros(HV, K, V)
        o_seq, S = step(q[b, s:e], k[b, s:e], v[b, s:e], g[b, s:e], beta[b, s:e], S0)
        o[b, s:e] = o_seq
        states.append(S)
    final_state = torch.stack(states) if output_final_state else None  # fp32, or fp64 for fp64 inputs
    return o.to(out_dtype), final_state


def _recurrent_step(q, k, v, g, beta, S):
    o = torch.empty_like(v)
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], S))
        S = S + k[t][:, :, None] * u[:, None, :]
        o[t] = torch.einsum("hk,hkv->hv", q[t], S)
    return o, S


def _chunk_step(q, k, v, g, beta, S, chunk_size=CHUNK_SIZE):
    T = q.shape[0]
    o = torch.empty_like(v)
    for s in range(0, T, chunk_size):
        e = min(s + chunk_size, T)
        # [HV, C, *] layout inside the chunk.
        qc, kc, vc = (x[s:e].transpose(0, 1) for x in (q, k, v))
        gc, bc = g[s:e].transpose(0, 1), beta[s:e].transpose(0, 1)
        G = gc.cumsum(-1)  # in-chunk cumulative log-decay, [HV, C]
        decay = (G[:, :, None] - G[:, None, :]).tril().exp().tril()  # exp(G_i - G_j) for j <= i
        C = e - s
        strictly_lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
        # (I + L) u = beta * (v - exp(G) k S0), L[i, j] = beta_i exp(G_i - G_j) k_i.k_j for j < i.
        L = (bc[:, :, None] * (kc @ kc.transpose(1, 2)) * decay) * strictly_lower
        eye = torch.eye(C, dtype=q.dtype, device=q.device)
        rhs = torch.cat([bc[..., None] * vc, bc[..., None] * G.exp()[..., None] * kc], dim=-1)
        sol = torch.linalg.solve_triangular(eye + L, rhs, upper=False, unitriangular=True)
        U, W = sol[..., : vc.shape[-1]], sol[..., vc.shape[-1] :]
        u = U - W @ S  # [HV, C, V]
        attn = (qc @ kc.transpose(1, 2)) * decay * (strictly_lower | torch.eye(C, dtype=torch.bool, device=q.device))
        o[s:e] = ((G.exp()[..., None] * qc) @ S + attn @ u).transpose(0, 1)
        G_last = G[:, -1:]
        S = G_last.exp()[..., None] * S + (kc * (G_last - G).exp()[..., None]).transpose(1, 2) @ u
    return o, S


def recurrent_gated_delta_rule_ref(
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
):
    """Token-by-token gated delta rule; the golden for every other implementation.
    Same arguments and returns as `chunk_gated_delta_rule`."""
    return _run_per_sequence(
        _recurrent_step,
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        use_qk_l2norm_in_kernel,
        cu_seqlens,
        cu_seqlens_cpu,
    )


def chunk_gated_delta_rule_ref(
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
):
    """Chunked (64 tokens) gated delta rule in plain PyTorch; equals the recurrent form.

    Args:
        q, k: [B, T, H, K] queries and keys.
        v: [B, T, HV, V] values, HV a multiple of H (value head j uses q/k head j // (HV // H)).
        g: [B, T, HV] log-decay per token (<= 0 in practice; any finite value works).
        beta: [B, T, HV] delta-rule step size.
        scale: query scale, default K ** -0.5.
        initial_state: optional [N, HV, K, V] state per sequence (N = B, or len(cu_seqlens) - 1).
        output_final_state: also return the state after the last token of each sequence.
        use_qk_l2norm_in_kernel: l2-normalise q and k over K first (eps 1e-6).
        cu_seqlens: optional [N+1] int offsets of packed sequences (needs B == 1); the state
            restarts at each sequence.
        cu_seqlens_cpu: optional host copy of cu_seqlens (`ops/varlen.py`): the op then reads no offsets back
            from the device.
    Returns:
        o: [B, T, HV, V] in v's dtype; final_state: [N, HV, K, V] fp32 (fp64 for fp64 inputs) or None.
    Raises:
        ValueError: bad shapes, mixed q/k/v dtypes, or bad cu_seqlens.
    """
    return _run_per_sequence(
        _chunk_step,
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        use_qk_l2norm_in_kernel,
        cu_seqlens,
        cu_seqlens_cpu,
    )
