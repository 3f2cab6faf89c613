"""Exact mode's gated delta rule: the trainer's packed forward is the decode step applied token by token,
in PyTorch here (the CPU form) and in one Triton kernel on devices (`exact_kernel.py`).

`gated_delta_rule_step_torch` is the one per-token arithmetic (the `gdn.step` op's math with every
contraction written as a product and a sum over K of fixed size, where `gated_delta_rule_step` uses
einsums whose batched kernels may change with the row count). `recurrent_gated_delta_rule_exact` runs a
packed batch through it: at token t every sequence still running takes one step, so a token's output and
the state it leaves are bitwise those of the decode step at the same position, whatever the packing. Its
gradient is the chunked reference's (`chunk_gated_delta_rule_ref`), recomputed in backward.
"""

from __future__ import annotations

import torch

from ..exact import by_device, device_default, exact_forward
from ..varlen import HostOffsets, seq_bounds
from .exact_kernel import gated_delta_rule_rows_triton
from .positions import gdn_positions_by_steps
from .reference import check_gdn_inputs, chunk_gated_delta_rule_ref
from .step import _keep_inactive, check_gdn_step_inputs


def gated_delta_rule_step_torch(
    q, k, v, g, beta, state, scale=None, use_qk_l2norm_in_kernel=False, active=None, inplace=False
):
    """The `gdn.step` op's contract (`step.gated_delta_rule_step`), by reductions of fixed size per row."""
    check_gdn_step_inputs(q, k, v, g, beta, state, active, inplace)
    out_dtype = v.dtype
    cd = torch.promote_types(out_dtype, torch.float32)
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (t.to(cd).contiguous() for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    group = v.shape[1] // q.shape[1]
    q = q.repeat_interleave(group, dim=1) * scale
    k = k.repeat_interleave(group, dim=1)[..., :, None]  # [N, HV, K, 1]
    S = state.to(cd) * g.exp()[..., None, None]
    u = beta[..., None] * (v - (k * S).sum(-2))
    S = S + k * u[..., None, :]
    o = (q[..., :, None] * S).sum(-2)
    return o.to(out_dtype), _keep_inactive(S, state, active, inplace)


def _recurrent_by_steps(
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
    cu_seqlens_cpu: HostOffsets | None = None,
):
    """`chunk_gated_delta_rule_ref`'s contract, one `gated_delta_rule_step_torch` per token position."""
    check_gdn_inputs(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu)
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    cd = torch.promote_types(v.dtype, torch.float32)
    bounds = [(b * T + s, b * T + e) for b in range(B) for s, e in seq_bounds(cu_seqlens, T, cu_seqlens_cpu)]
    if initial_state is None:
        state = torch.zeros(len(bounds), HV, K, V, dtype=cd, device=v.device)
    else:
        state = initial_state.to(cd).clone()
    starts = torch.tensor([s for s, _ in bounds], dtype=torch.long, device=v.device)
    lengths = torch.tensor([e - s for s, e in bounds], dtype=torch.long, device=v.device)
    flat = [t.reshape(B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]
    o = v.new_zeros(B * T, HV, V)
    for t in range(max((e - s for s, e in bounds), default=0)):
        rows = (lengths > t).nonzero()[:, 0]  # the sequences that have a token t
        token = starts[rows] + t
        o[token], state[rows] = gated_delta_rule_step_torch(
            *(x[token] for x in flat), state[rows], scale, use_qk_l2norm_in_kernel
        )
    return o.reshape(B, T, HV, V), state if output_final_state else None


def _step_by_kernel(q, k, v, g, beta, state, scale=None, use_qk_l2norm_in_kernel=False, active=None, inplace=False):
    """The `gdn.step` op's contract by the exact kernel: N sequences of one token (none for an inactive row,
    whose state stays and whose output is zeros)."""
    check_gdn_step_inputs(q, k, v, g, beta, state, active, inplace)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    count = torch.ones(q.shape[0], dtype=torch.bool, device=q.device) if active is None else active
    if not inplace:
        state = state.float()
    return gated_delta_rule_rows_triton(q, k, v, g, beta, state, None, count, scale, use_qk_l2norm_in_kernel, inplace)


def _recurrent_by_kernel(
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
    cu_seqlens_cpu: HostOffsets | None = None,
):
    """`chunk_gated_delta_rule_ref`'s contract by the exact kernel: each sequence's tokens in order."""
    check_gdn_inputs(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu)
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    scale = K**-0.5 if scale is None else scale
    if cu_seqlens is None:
        starts = torch.arange(B, device=v.device) * T
        lengths = torch.full_like(starts, T)
    else:
        bounds = cu_seqlens.to(v.device, torch.long)
        starts, lengths = bounds[:-1], bounds[1:] - bounds[:-1]
    N = starts.shape[0]
    if initial_state is None:
        state = torch.zeros(N, HV, K, V, dtype=torch.float32, device=v.device)
    else:
        state = initial_state.float()
    flat = [t.reshape(B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]
    o, final = gated_delta_rule_rows_triton(*flat, state, starts, lengths, scale, use_qk_l2norm_in_kernel)
    return o.reshape(B, T, HV, V), final if output_final_state else None


# the dispatched "exact" step: the torch form on cpu, the exact kernel on devices
gated_delta_rule_step_exact = by_device(gated_delta_rule_step_torch, _step_by_kernel)


def gated_delta_rule_positions_exact(
    q, k, v, g, beta, state, scale=None, use_qk_l2norm_in_kernel=False, counts=None, advance=False
):
    """The `gdn.positions` op's contract (`positions.gated_delta_rule_positions`) by the exact step, position by
    position (exact mode refuses speculation; this keeps the op complete)."""
    return gdn_positions_by_steps(
        gated_delta_rule_step_exact, q, k, v, g, beta, state, scale, use_qk_l2norm_in_kernel, counts, advance
    )


# the dispatched "exact" gated delta rule: token-by-token steps forward (torch on cpu, the exact kernel on
# devices), the chunked form's gradient (the reference on cpu, the device's chunked kernels there)
recurrent_gated_delta_rule_exact = exact_forward(
    by_device(_recurrent_by_steps, _recurrent_by_kernel),
    by_device(chunk_gated_delta_rule_ref, device_default("gdn")),
)

__all__ = [
    "gated_delta_rule_positions_exact",
    "gated_delta_rule_step_exact",
    "gated_delta_rule_step_torch",
    "recurrent_gated_delta_rule_exact",
]
