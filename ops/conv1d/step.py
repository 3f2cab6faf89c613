"""One-token step of the depthwise causal conv1d (GatedDeltaNet's short conv), for decoding.

A sequence's conv state is its last W-1 conv inputs [C, W-1], oldest first, zeros before the
sequence start. Stepping one token x: window = [state | x] [C, W], out = act(sum_w weight[:, w] *
window[:, w] + bias), state' = window[:, 1:]. Stepping a whole sequence from a zero state gives
`causal_conv1d_ref` of that sequence; `conv1d_state_from_prefill` is the state a prefill leaves.

The op resolves as `resolve("conv1d.step")` (IMPLS below): `causal_conv1d_step_ref` (torch, the CPU
path) or `step_kernel.causal_conv1d_step_triton` (the cuda/npu default: one pass that reads each state
once and, in place, writes it once; torch's form runs ~6 kernels over [N, C, W] copies).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..varlen import HostOffsets, check_cu_seqlens
from .reference import ACTIVATIONS

IMPLS = {
    "torch": "verl_moe.ops.conv1d.step:causal_conv1d_step_ref",
    "triton": "verl_moe.ops.conv1d.step_kernel:causal_conv1d_step_triton",
    "exact": "verl_moe.ops.conv1d.exact:causal_conv1d_step_exact",
}


def check_conv1d_step_inputs(x, conv_state, weight, bias, activation, active=None) -> None:
    """Raise ValueError for shapes, dtypes or activation the step cannot take."""
    if x.dim() != 2:
        raise ValueError(f"x must be [N, C], got {tuple(x.shape)}")
    N, C = x.shape
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 1:
        raise ValueError(f"weight must be [C, W] with C={C}, got {tuple(weight.shape)}")
    W = weight.shape[1]
    if tuple(conv_state.shape) != (N, C, W - 1):
        raise ValueError(f"conv_state must be [N, C, W-1] = {(N, C, W - 1)}, got {tuple(conv_state.shape)}")
    if not (x.is_floating_point() and weight.is_floating_point() and conv_state.is_floating_point()):
        raise ValueError(
            f"x, conv_state, weight must be floating point, got {x.dtype}, {conv_state.dtype}, {weight.dtype}"
        )
    if bias is not None and tuple(bias.shape) != (C,):
        raise ValueError(f"bias must be [C] with C={C}, got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if active is not None and (active.dtype != torch.bool or tuple(active.shape) != (N,)):
        raise ValueError(f"active must be a [N] = ({N},) bool tensor, got {tuple(active.shape)} {active.dtype}")


def causal_conv1d_step_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    active: torch.Tensor | None = None,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advance N sequences by one token each (the dispatched `conv1d.step` op).

    Args:
        x: [N, C] this token's conv inputs, one row per sequence.
        conv_state: [N, C, W-1] the previous W-1 inputs of each sequence, oldest first.
        weight: [C, W] taps; tap W-1 multiplies the current token. bias: optional [C].
        activation: "silu" (alias "swish") or None.
        active: optional [N] bool; an inactive row's state is returned (and left) as it was.
        inplace: write the new state into `conv_state` and return it.
    Returns:
        out: [N, C] in x's dtype (math in fp32, fp64 for fp64 inputs; an inactive row's is computed
        all the same); new_state: [N, C, W-1] in conv_state's dtype (a new tensor unless `inplace`).
    Raises:
        ValueError: bad shapes, dtypes or activation.
    """
    return conv1d_step(x, conv_state, weight, bias, activation, active, inplace, weighted_sum)


def weighted_sum(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum_w window[..., w] * weight[:, w] over windows [..., C, W] and weight [C, W] (one reduction)."""
    return (window * weight).sum(-1)


def conv1d_step(x, conv_state, weight, bias, activation, active, inplace, taps):
    """`causal_conv1d_step_ref` with the taps combined by `taps(window [N, C, W], weight [C, W])`, both in
    the compute dtype."""
    check_conv1d_step_inputs(x, conv_state, weight, bias, activation, active)
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    window = torch.cat([conv_state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [N, C, W], values as stored
    out = taps(window.to(cd), weight.to(cd))
    if bias is not None:
        out = out + bias.to(cd)
    if activation is not None:
        out = F.silu(out)
    new_state = window[..., 1:].to(conv_state.dtype)
    if active is not None:
        new_state = torch.where(active[:, None, None], new_state, conv_state)
    return out.to(x.dtype), conv_state.copy_(new_state) if inplace else new_state


def conv1d_state_from_prefill(
    x: torch.Tensor,
    width: int,
    cu_seqlens: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    cu_seqlens_cpu: HostOffsets | None = None,
) -> torch.Tensor:
    """The conv state each sequence has after its prompt: its last W-1 conv inputs, zero-padded on
    the left when the prompt is shorter than W-1 (one gather for all sequences).

    Args:
        x: [B, T, C] conv inputs of the prompts (B == 1 with cu_seqlens [N+1], else one per row).
        width: the conv width W. dtype: state dtype, default x's.
        cu_seqlens_cpu: cu_seqlens as host ints (then its values are not read from the device).
    Returns:
        [N, C, W-1] (N = B without cu_seqlens).
    Raises:
        ValueError: bad shapes or cu_seqlens.
    """
    if x.dim() != 3 or width < 1:
        raise ValueError(f"x must be [B, T, C] and width >= 1, got {tuple(x.shape)} and {width}")
    B, T, C = x.shape
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"varlen input (cu_seqlens) needs B == 1, got B={B}")
        check_cu_seqlens(cu_seqlens, T, cu_seqlens_cpu)
        bounds = cu_seqlens.to(x.device, torch.long)
        starts, ends = bounds[:-1], bounds[1:]
    else:
        starts = torch.arange(B, device=x.device) * T
        ends = starts + T
    rows = x.reshape(B * T, C)
    index = ends[:, None] + torch.arange(1 - width, 0, device=x.device)  # [N, W-1] the last W-1 positions
    before = index < starts[:, None]  # positions before the sequence start: zeros
    state = torch.where(before[..., None], 0, rows[index.clamp(min=0)])  # [N, W-1, C]
    return state.transpose(1, 2).to(dtype or x.dtype).contiguous()


__all__ = [
    "IMPLS",
    "causal_conv1d_step_ref",
    "check_conv1d_step_inputs",
    "conv1d_state_from_prefill",
    "conv1d_step",
    "weighted_sum",
]
