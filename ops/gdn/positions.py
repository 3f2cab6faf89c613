"""The gated delta rule's decode step over several positions per row: speculative decoding's verification
(the token sampled last and the drafts, from each row's state, the state left as it was) and its commit
(the state stepped through the positions kept).

`gated_delta_rule_positions` runs the `gdn.step` op position by position on a working copy (the CPU path);
`step_kernel.gated_delta_rule_positions_triton` does it in one kernel that keeps each state tile in registers
across the positions (the cuda/npu default: one read of the state per layer instead of one read and write per
position, and one launch). The op resolves as `resolve("gdn.positions")` (IMPLS below).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .step import check_gdn_step_inputs, gated_delta_rule_step

IMPLS = {
    "torch": "verl_moe.ops.gdn.positions:gated_delta_rule_positions",
    "triton": "verl_moe.ops.gdn.step_kernel:gated_delta_rule_positions_triton",
    "exact": "verl_moe.ops.gdn.exact:gated_delta_rule_positions_exact",
}


def check_gdn_positions_inputs(q, k, v, g, beta, state, counts=None, advance=False) -> None:
    """Raise ValueError for shapes or dtypes `gated_delta_rule_positions` cannot take."""
    if q.dim() != 4 or v.dim() != 4 or g.dim() != 3 or beta.dim() != 3:
        raise ValueError(
            f"q, k must be [N, T, H, K], v [N, T, HV, V], g and beta [N, T, HV]; got q {tuple(q.shape)}, "
            f"v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}"
        )
    N, T = q.shape[:2]
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if tuple(t.shape[:2]) != (N, T):
            raise ValueError(f"{name} must have [N, T] = {(N, T)} leading dims, got {tuple(t.shape)}")
    check_gdn_step_inputs(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, None, inplace=True)
    if counts is not None and (tuple(counts.shape) != (N,) or counts.is_floating_point() or counts.is_complex()):
        raise ValueError(f"counts must be a [N] = ({N},) integer tensor, got {tuple(counts.shape)} {counts.dtype}")


def gdn_positions_by_steps(step: Callable, q, k, v, g, beta, state, scale, use_qk_l2norm_in_kernel, counts, advance):
    """The `gdn.positions` contract from a `gdn.step` form `step`: one in-place step per position on the state
    (a copy of it unless advancing), rows past their counts held (active = counts > t)."""
    check_gdn_positions_inputs(q, k, v, g, beta, state, counts, advance)
    work = state if advance else state.clone()
    outputs = []
    for t in range(q.shape[1]):
        active = None if counts is None else counts > t
        o, _ = step(
            q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], work, scale, use_qk_l2norm_in_kernel, active, inplace=True
        )
        outputs.append(o)
    return torch.stack(outputs, 1)


def gated_delta_rule_positions(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    counts: torch.Tensor | None = None,
    advance: bool = False,
) -> torch.Tensor:
    """Run each of N rows through its first counts[n] of T positions, in order, from its state (the dispatched
    `gdn.positions` op).

    Args:
        q, k: [N, T, H, K]; v: [N, T, HV, V]; g, beta: [N, T, HV]: position t of row n as the `gdn.step` op
            takes one token.
        state: [N, HV, K, V] fp32 (fp64 for fp64 inputs) each row's state before position 0.
        scale, use_qk_l2norm_in_kernel: as `gdn.step`.
        counts: [N] integer, values in 0..T: the positions each row runs (None: all T).
        advance: leave each row's state, in place, after its counts[n] positions (rows of 0 keep theirs);
            False: `state` is not written.
    Returns:
        o [N, T, HV, V] in v's dtype: at t < counts[n] the step's output at position t (the state left by the
        positions before it), past it undefined.
    Raises:
        ValueError: bad shapes, dtypes or counts, or a state not in the compute dtype.
    """
    return gdn_positions_by_steps(
        gated_delta_rule_step, q, k, v, g, beta, state, scale, use_qk_l2norm_in_kernel, counts, advance
    )


__all__ = ["IMPLS", "check_gdn_positions_inputs", "gated_delta_rule_positions", "gdn_positions_by_steps"]
