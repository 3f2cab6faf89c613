"""One-token step of the gated delta rule (the recurrent form), for decoding.

Per value head, with state S [K, V]: S <- S * exp(g); u = beta * (v - S^T k); S <- S + k u^T;
o = S^T (scale * q) (see `reference.py`). `gated_delta_rule_step_ref` runs the token-by-token
reference (`recurrent_gated_delta_rule_ref`) for one token per sequence; `gated_delta_rule_step`
is the same math batched over the N sequences in a few einsums (the CPU path);
`step_kernel.gated_delta_rule_step_triton` does it in one kernel that reads and writes each state tile once
(the cuda/npu default: a decode step is bound by the [N, HV, K, V] fp32 state traffic, which the
einsum form moves about five times).

The op resolves as `resolve("gdn.step")` (IMPLS below).
"""

from __future__ import annotations

import torch

from .reference import recurrent_gated_delta_rule_ref

IMPLS = {
    "torch": "verl_moe.ops.gdn.step:gated_delta_rule_step",
    "triton": "verl_moe.ops.gdn.step_kernel:gated_delta_rule_step_triton",
    "reference": "verl_moe.ops.gdn.step:gated_delta_rule_step_ref",
    "exact": "verl_moe.ops.gdn.exact:gated_delta_rule_step_exact",
}


def rows_of_contiguous_heads(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[rows, heads, dim] tensors as the step kernels read them: each row's heads contiguous, rows at any stride.
    Head slices of one conv output (the decoder's q, k, v: a row stride above their width) pass as they are;
    anything else is copied."""
    return tuple(t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous() for t in tensors)


def check_gdn_step_inputs(q, k, v, g, beta, state, active=None, inplace=False) -> None:
    """Raise ValueError for shapes or dtypes the step cannot take."""
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [N, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    N, H, K = q.shape
    if v.dim() != 3 or v.shape[0] != N:
        raise ValueError(f"v must be [N, HV, V] with N={N}, got {tuple(v.shape)}")
    HV, V = v.shape[1:]
    if HV % H:
        raise ValueError(f"value heads HV={HV} must be a multiple of q/k heads H={H}")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (N, HV):
            raise ValueError(f"{name} must be [N, HV] = {(N, HV)}, got {tuple(t.shape)}")
    if tuple(state.shape) != (N, HV, K, V):
        raise ValueError(f"state must be [N, HV, K, V] = {(N, HV, K, V)}, got {tuple(state.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if active is not None and (active.dtype != torch.bool or tuple(active.shape) != (N,)):
        raise ValueError(f"active must be a [N] = ({N},) bool tensor, got {tuple(active.shape)} {active.dtype}")
    if inplace and state.dtype != (torch.float64 if v.dtype == torch.float64 else torch.float32):
        raise ValueError(f"an in-place step needs the state in its compute dtype, got {state.dtype}")


def gated_delta_rule_step_ref(
    q, k, v, g, beta, state, scale=None, use_qk_l2norm_in_kernel=False, active=None, inplace=False
):
    """The recurrent reference for one token of each of N sequences; arguments and returns as
    `gated_delta_rule_step`."""
    check_gdn_step_inputs(q, k, v, g, beta, state, active, inplace)
    o, new_state = recurrent_gated_delta_rule_ref(
        q[:, None],
        k[:, None],
        v[:, None],
        g[:, None],
        beta[:, None],
        scale=scale,
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
    return o[:, 0], _keep_inactive(new_state, state, active, inplace)


def _keep_inactive(new_state, state, active, inplace):
    """The step's returned state: inactive rows keep `state`'s; written into `state` when in place."""
    if active is not None:
        new_state = torch.where(active[:, None, None, None], new_state, state.to(new_state.dtype))
    return state.copy_(new_state) if inplace else new_state


def gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    active: torch.Tensor | None = None,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advance N sequences by one token each (the dispatched `gdn.step` op).

    Args:
        q, k: [N, H, K] this token's queries and keys. v: [N, HV, V], HV a multiple of H (value
            head j reads q/k head j // (HV // H)).
        g: [N, HV] log-decay; beta: [N, HV] step size.
        state: [N, HV, K, V] each sequence's state before this token (any float dtype).
        scale: query scale, default K ** -0.5.
        use_qk_l2norm_in_kernel: l2-normalise q and k over K first (eps 1e-6, as the chunked op).
        active: optional [N] bool; rows where it is False keep their state (their o is undefined),
            so a decode batch of fixed size can carry idle slots.
        inplace: write the new state into `state` (which must then be fp32, fp64 for fp64 inputs)
            and return it: a decode step then moves each state tile once.
    Returns:
        o: [N, HV, V] in v's dtype; new_state: [N, HV, K, V] fp32 (fp64 for fp64 inputs), a new
        tensor unless `inplace`.
    Raises:
        ValueError: bad shapes, mixed q/k/v dtypes, a bad `active`, an in-place state of another dtype.
    """
    check_gdn_step_inputs(q, k, v, g, beta, state, active, inplace)
    out_dtype = v.dtype
    cd = torch.float64 if out_dtype == torch.float64 else torch.float32
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (t.to(cd) for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    group = v.shape[1] // q.shape[1]
    q = q.repeat_interleave(group, dim=1) * scale
    k = k.repeat_interleave(group, dim=1)
    S = state.to(cd) * g.exp()[..., None, None]
    u = beta[..., None] * (v - torch.einsum("nhk,nhkv->nhv", k, S))
    S = S + k[..., :, None] * u[..., None, :]
    o = torch.einsum("nhk,nhkv->nhv", q, S)
    return o.to(out_dtype), _keep_inactive(S, state, active, inplace)


__all__ = ["IMPLS", "check_gdn_step_inputs", "gated_delta_rule_step", "gated_delta_rule_step_ref"]
