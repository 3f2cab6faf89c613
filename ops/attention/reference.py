"""Causal grouped-query attention over packed sequences: SDPA run once per sequence.

With `cu_seqlens` (B == 1) each packed sequence attends only to itself, causally; without it
every batch row is one causal sequence. `causal=False` lifts the causal mask inside each sequence
(the vision tower's attention over the patches of one image). The math is SDPA's in the input dtype (so fp64 inputs
give an fp64 golden); transformers' eager path is the same up to fp32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..varlen import HostOffsets, check_cu_seqlens, seq_bounds


def check_attention_inputs(q, k, v, cu_seqlens, cu_seqlens_cpu=None) -> None:
    """Raise ValueError for shapes, dtypes or cu_seqlens the op cannot take."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be [B, T, H, K], [B, T, HKV, K], [B, T, HKV, V]; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, T, H, K = q.shape
    if k.shape[:2] != (B, T) or k.shape[3] != K or v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"k must be [B={B}, T={T}, HKV, K={K}] and v [B, T, HKV, V]; got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if H % k.shape[2]:
        raise ValueError(f"query heads H={H} must be a multiple of key/value heads HKV={k.shape[2]}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"varlen input (cu_seqlens) needs B == 1, got B={B}")
        check_cu_seqlens(cu_seqlens, T, cu_seqlens_cpu)


def causal_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    causal: bool = True,
    cu_seqlens_cpu: HostOffsets | None = None,
) -> torch.Tensor:
    """Causal GQA attention (the dispatched `attention` op).

    Args:
        q: [B, T, H, K]; k: [B, T, HKV, K]; v: [B, T, HKV, V], H a multiple of HKV (query head h
            reads key/value head h // (H // HKV)).
        scale: softmax scale, default K ** -0.5.
        cu_seqlens: optional [N+1] int offsets of packed sequences (needs B == 1).
        causal: False: every token of a sequence sees the whole sequence.
        cu_seqlens_cpu: optional host copy of cu_seqlens (`ops/varlen.py`): the op then reads no offsets back
            from the device.
    Returns:
        o: [B, T, H, V] in q's dtype.
    Raises:
        ValueError: bad shapes, mixed dtypes, or bad cu_seqlens.
    """
    check_attention_inputs(q, k, v, cu_seqlens, cu_seqlens_cpu)
    B, T, H, _ = q.shape
    group = H // k.shape[2]
    # [B, heads, T, *] for SDPA; repeat k/v heads explicitly (enable_gqa is not on every backend).
    qh = q.transpose(1, 2)
    kh = k.repeat_interleave(group, dim=2).transpose(1, 2)
    vh = v.repeat_interleave(group, dim=2).transpose(1, 2)
    out = []
    for s, e in seq_bounds(cu_seqlens, T, cu_seqlens_cpu):
        out.append(
            F.scaled_dot_product_attention(qh[:, :, s:e], kh[:, :, s:e], vh[:, :, s:e], is_causal=causal, scale=scale)
        )
    return torch.cat(out, dim=2).transpose(1, 2)
