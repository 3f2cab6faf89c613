"""Exact mode's causal conv1d. On cpu every token of a packed batch goes through the decode step's
arithmetic with its own W-1 predecessors as the state, so a token's output is bitwise the decode step's at
the same position: the taps are added one at a time in order (`taps_in_order`), elementwise operations
whose result for one element never depends on the shape of the call; the gradient is the reference's,
recomputed in backward. On devices the fast Triton kernels are exact already: the packed forward and the
step add the bias, then the taps in order, by the same operations per element whatever their tiles
(`conv._conv1d_pre`, `step_kernel`), and the packed forward keeps its own backward.
"""

from __future__ import annotations

import torch

from ..exact import by_device, exact_forward
from ..varlen import HostOffsets, sequence_starts
from .conv import causal_conv1d as causal_conv1d_triton
from .positions import conv1d_positions_by_steps
from .reference import causal_conv1d_ref, check_conv1d_inputs
from .step import conv1d_step
from .step_kernel import causal_conv1d_positions_triton, causal_conv1d_step_triton


def taps_in_order(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum_w window[..., w] * weight[:, w] over windows [..., C, W], w = 0, 1, ...: a product, then an add."""
    out = window[..., 0] * weight[:, 0]
    for w in range(1, weight.shape[1]):
        out = out + window[..., w] * weight[:, w]
    return out


def _step_by_taps(x, conv_state, weight, bias=None, activation="silu", active=None, inplace=False):
    """The `conv1d.step` op's contract (`step.causal_conv1d_step_ref`) with the taps added in order."""
    return conv1d_step(x, conv_state, weight, bias, activation, active, inplace, taps_in_order)


# the dispatched "exact" step: the taps in order on cpu, the fast step kernel (the same order) on devices
causal_conv1d_step_exact = by_device(_step_by_taps, causal_conv1d_step_triton)


def _positions_by_taps(x, conv_state, weight, bias=None, activation="silu", counts=None, advance=False):
    """The `conv1d.positions` op's contract (`positions.causal_conv1d_positions_ref`) by `_step_by_taps`."""
    return conv1d_positions_by_steps(_step_by_taps, x, conv_state, weight, bias, activation, counts, advance)


# several positions per row (exact mode refuses speculation; this keeps the op complete): the taps in order on
# cpu, on devices the one-launch kernel, whose outputs are bitwise the step kernel's
causal_conv1d_positions_exact = by_device(_positions_by_taps, causal_conv1d_positions_triton)


def _conv1d_by_steps(
    x, weight, bias=None, activation="silu", cu_seqlens=None, cu_seqlens_cpu: HostOffsets | None = None
):
    """`causal_conv1d_ref`'s contract: one step per token, all tokens in one call."""
    check_conv1d_inputs(x, weight, bias, activation, cu_seqlens, cu_seqlens_cpu)
    B, T, C = x.shape
    W = weight.shape[1]
    start = sequence_starts(B, T, cu_seqlens, cu_seqlens_cpu, x.device)
    rows = x.reshape(B * T, C)
    index = torch.arange(B * T, device=x.device)[:, None] + torch.arange(1 - W, 0, device=x.device)  # [BT, W-1]
    before = (index < start[:, None])[..., None]  # predecessors outside the token's sequence read as zeros
    state = torch.where(before, 0, rows[index.clamp(min=0)]).transpose(1, 2)  # [BT, C, W-1], oldest first
    out, _ = _step_by_taps(rows, state, weight, bias, activation)
    return out.reshape(B, T, C)


# the dispatched "exact" conv1d: on cpu the step's arithmetic per token forward, the reference's gradient; on
# devices the fast kernel, forward and backward
causal_conv1d_exact = by_device(exact_forward(_conv1d_by_steps, causal_conv1d_ref), causal_conv1d_triton)

__all__ = ["causal_conv1d_exact", "causal_conv1d_positions_exact", "causal_conv1d_step_exact", "taps_in_order"]
