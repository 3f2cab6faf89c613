"""Depthwise causal conv1d (+ SiLU) over packed sequences: the short convolution in front of
Qwen3.5's gated delta rule. Output t of channel c is sum_w weight[c, w] * x[t - W + 1 + w, c]
(+ bias[c]), with x = 0 before the start of t's own sequence, so nothing leaks across
`cu_seqlens` boundaries. Computed in fp32 (fp64 for fp64 inputs), returned in x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..varlen import HostOffsets, check_cu_seqlens, seq_bounds

ACTIVATIONS = (None, "silu", "swish")


def check_conv1d_inputs(x, weight, bias, activation, cu_seqlens, cu_seqlens_cpu=None) -> None:
    """Raise ValueError for shapes, dtypes, activation or cu_seqlens the op cannot take."""
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, C], got {tuple(x.shape)}")
    if not x.is_floating_point() or not weight.is_floating_point():
        raise ValueError(f"x and weight must be floating point, got {x.dtype} and {weight.dtype}")
    C = x.shape[-1]
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"weight must be [C, W] with C={C}, got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (C,):
        raise ValueError(f"bias must be [C] with C={C}, got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if cu_seqlens is not None:
        if x.shape[0] != 1:
            raise ValueError(f"varlen input (cu_seqlens) needs B == 1, got B={x.shape[0]}")
        check_cu_seqlens(cu_seqlens, x.shape[1], cu_seqlens_cpu)


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: HostOffsets | None = None,
) -> torch.Tensor:
    """Depthwise causal conv1d with optional SiLU (the dispatched `conv1d` op).

    Args:
        x: [B, T, C] activations (C = channels, e.g. 2 * H * K + HV * V for Qwen3.5 q|k|v).
        weight: [C, W] per-channel taps; tap W - 1 multiplies the current token.
        bias: optional [C].
        activation: "silu" (alias "swish") or None.
        cu_seqlens: optional [N+1] int offsets of packed sequences (needs B == 1); each sequence
            starts from zero left padding.
        cu_seqlens_cpu: optional host copy of cu_seqlens (`ops/varlen.py`): the op then reads no offsets back
            from the device.
    Returns:
        [B, T, C] in x's dtype.
    Raises:
        ValueError: bad shapes, dtypes, activation or cu_seqlens.
    """
    check_conv1d_inputs(x, weight, bias, activation, cu_seqlens, cu_seqlens_cpu)
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    B, T, C = x.shape
    W = weight.shape[1]
    w = weight.to(cd).unsqueeze(1)  # [C, 1, W] for grouped conv1d
    b = None if bias is None else bias.to(cd)
    if T == 0:
        # No tokens: an empty result that is still a function of the inputs, so backward gives an
        # empty dx and zero dweight / dbias instead of failing.
        out = x.to(cd) * w[:, 0, -1] + (0.0 if b is None else b)
        return (F.silu(out) if activation is not None else out).to(x.dtype)
    out = torch.empty(B, T, C, dtype=cd, device=x.device)
    for s, e in seq_bounds(cu_seqlens, T, cu_seqlens_cpu):
        if e == s:  # an empty packed sequence: nothing to compute (F.conv1d refuses a W-1 long input)
            continue
        seg = x[:, s:e].to(cd).transpose(1, 2)  # [B, C, T_seq]
        y = F.conv1d(F.pad(seg, (W - 1, 0)), w, b, groups=C)
        out[:, s:e] = y.transpose(1, 2)
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype)
