"""Exact mode's causal conv1d, in PyTorch (the CPU form): every token of a packed batch goes through the
decode step's arithmetic (`step.causal_conv1d_step_ref`) with its own W-1 predecessors as the state, so a
token's output is bitwise the decode step's at the same position. Its gradient is the reference's
(`causal_conv1d_ref`), recomputed in backward.
"""

from __future__ import annotations

import torch

from ..exact import exact_forward
from ..varlen import HostOffsets, sequence_starts
from .reference import causal_conv1d_ref, check_conv1d_inputs
from .step import causal_conv1d_step_ref


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
    out, _ = causal_conv1d_step_ref(rows, state, weight, bias, activation)
    return out.reshape(B, T, C)


# the dispatched "exact" conv1d: the step's arithmetic per token forward, the reference's gradient
causal_conv1d_exact = exact_forward(_conv1d_by_steps, causal_conv1d_ref)

__all__ = ["causal_conv1d_exact"]
