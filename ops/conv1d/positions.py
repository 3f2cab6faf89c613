"""Several positions per sequence of the causal conv1d's decode step, in one call.

Speculative decoding verifies k + 1 positions per sequence at once: row n of x [N, T, C] runs its first
counts[n] positions, in order, from its conv state, each exactly as a one-token `conv1d.step` on the
state the earlier ones left. The op resolves as `resolve("conv1d.positions")` (IMPLS below): the loop
of torch steps (the CPU path), or `step_kernel.causal_conv1d_positions_triton`, one launch of the
step's kernel for all T positions instead of T launches on a copy of the state.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .step import causal_conv1d_step_ref, check_conv1d_step_inputs

IMPLS = {
    "torch": "verl_moe.ops.conv1d.positions:causal_conv1d_positions_ref",
    "triton": "verl_moe.ops.conv1d.step_kernel:causal_conv1d_positions_triton",
    "exact": "verl_moe.ops.conv1d.exact:causal_conv1d_positions_exact",
}

COUNT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def check_conv1d_positions_inputs(x, conv_state, weight, bias, activation, counts, advance) -> None:
    """Raise ValueError for shapes, dtypes, activation, counts or a state the op cannot take."""
    if x.dim() != 3:
        raise ValueError(f"x must be [N, T, C], got {tuple(x.shape)}")
    N, _, C = x.shape
    # the step's checks on one position's shape (a meta tensor: valid for T == 0 too)
    check_conv1d_step_inputs(x.new_empty((N, C), device="meta"), conv_state, weight, bias, activation)
    if counts is not None and (
        counts.dtype not in COUNT_DTYPES or tuple(counts.shape) != (N,) or counts.device != x.device
    ):
        raise ValueError(
            f"counts must be a [N] = ({N},) integer tensor on {x.device}, "
            f"got {tuple(counts.shape)} {counts.dtype} on {counts.device}"
        )
    if advance and not conv_state.is_contiguous():
        raise ValueError("advancing the state in place needs a contiguous conv_state")


def conv1d_positions_by_steps(step: Callable, x, conv_state, weight, bias, activation, counts, advance):
    """The `conv1d.positions` contract from a `conv1d.step` form `step`: one out-of-place step per
    position on the state the earlier ones left, rows past their counts held (active = counts > t)."""
    check_conv1d_positions_inputs(x, conv_state, weight, bias, activation, counts, advance)
    N, T, C = x.shape
    state, outs = conv_state, []
    for t in range(T):
        out, state = step(x[:, t], state, weight, bias, activation, None if counts is None else counts > t)
        outs.append(out)
    if advance and T:
        conv_state.copy_(state)
    return torch.stack(outs, 1) if outs else x.new_empty(N, 0, C)


def causal_conv1d_positions_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    counts: torch.Tensor | None = None,
    advance: bool = False,
) -> torch.Tensor:
    """Run up to T positions of N sequences from their conv states (the dispatched `conv1d.positions` op).

    Args:
        x: [N, T, C] the positions' conv inputs (any strides; e.g. a column slice of a wider projection).
        conv_state: [N, C, W-1] each sequence's previous W-1 inputs, oldest first.
        weight: [C, W] taps. bias: optional [C]. activation: "silu" (alias "swish") or None.
        counts: optional [N] integer tensor on x's device, values in 0..T: row n runs its first counts[n]
            positions (None: all T).
        advance: set each row's conv_state, in place, to the state after its counts[n] positions (the
            last W-1 inputs of [state | x[n, :counts[n]]]; a row with none keeps its own). Without it
            conv_state is never written.
    Returns:
        out: [N, T, C] in x's dtype: at t < counts[n] what T successive `causal_conv1d_step_ref` calls
        give; past counts[n] undefined.
    Raises:
        ValueError: bad shapes, dtypes, activation or counts; advance with a non-contiguous state.
    """
    return conv1d_positions_by_steps(causal_conv1d_step_ref, x, conv_state, weight, bias, activation, counts, advance)


__all__ = [
    "IMPLS",
    "causal_conv1d_positions_ref",
    "check_conv1d_positions_inputs",
    "conv1d_positions_by_steps",
]
