"""Rotary position embedding references: inverse frequencies, cos/sin from position ids
(plain 1-D positions or Qwen3.5's interleaved multimodal mRoPE), and the rotation of q/k.

Numerics follow transformers: frequencies and cos/sin in fp32 (fp64 when asked), cast to the
activation dtype before the rotation; `rotate_half` pairing (dim i with dim i + rotary_dim/2);
partial rotary: only the first `rotary_dim` features of each head rotate, the rest pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def rope_inv_freq(
    head_dim: int,
    theta: float,
    partial_rotary_factor: float = 1.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] with rotary_dim = int(head_dim * partial_rotary_factor).
    Raises ValueError when rotary_dim is not a positive even number <= head_dim."""
    rotary_dim = int(head_dim * partial_rotary_factor)
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(
            f"rotary_dim = int(head_dim {head_dim} * partial_rotary_factor {partial_rotary_factor}) "
            f"= {rotary_dim} must be even, positive and <= head_dim"
        )
    # int64 arange then cast, as transformers does, so the fp32 values agree bit for bit.
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).to(dtype) / rotary_dim
    return 1.0 / (theta**exponent)


def mrope_rows(half_dim: int, mrope_section: Sequence[int], device=None) -> torch.Tensor:
    """Which position row (0 = temporal, 1 = height, 2 = width) drives each of the half_dim
    frequencies in interleaved mRoPE: frequency i uses row i % 3 when i < 3 * mrope_section[i % 3]
    for rows 1 and 2, else row 0 ([T H W T H W ... T T]). Returns [half_dim] int64."""
    i = torch.arange(half_dim, device=device)
    rows = torch.zeros(half_dim, dtype=torch.int64, device=device)
    for row in (1, 2):
        rows[(i % 3 == row) & (i < 3 * mrope_section[row])] = row
    return rows


def rope_cos_sin(
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for the given positions.

    Args:
        position_ids: [B, T] int positions, or [3, B, T] (temporal, height, width) with mrope_section;
            [B, T] with mrope_section is treated as three identical rows (text).
        inv_freq: [rotary_dim / 2] float; its dtype is the compute dtype (fp32 or fp64).
        mrope_section: three non-negative ints (e.g. [11, 11, 10]) for interleaved mRoPE, or None.
        dtype: output dtype (default inv_freq.dtype).
    Returns:
        cos, sin: [B, T, rotary_dim] (the frequencies repeated twice, rotate_half layout).
    Raises:
        ValueError: non-integer or wrongly shaped position_ids, bad mrope_section.
    """
    if position_ids.is_floating_point() or position_ids.is_complex():
        raise ValueError(f"position_ids must be an integer tensor, got {position_ids.dtype}")
    if mrope_section is None:
        if position_ids.dim() != 2:
            raise ValueError(f"position_ids must be [B, T] without mrope_section, got {tuple(position_ids.shape)}")
        freqs = position_ids.to(inv_freq.dtype)[..., None] * inv_freq
    else:
        if len(mrope_section) != 3 or any(int(s) < 0 for s in mrope_section):
            raise ValueError(f"mrope_section must be three non-negative ints, got {list(mrope_section)}")
        if position_ids.dim() == 2:
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        if position_ids.dim() != 3 or position_ids.shape[0] != 3:
            raise ValueError(f"position_ids must be [B, T] or [3, B, T] with mrope, got {tuple(position_ids.shape)}")
        freqs_3 = position_ids.to(inv_freq.dtype)[..., None] * inv_freq  # [3, B, T, rotary_dim / 2]
        rows = mrope_rows(inv_freq.shape[0], mrope_section, device=inv_freq.device)
        index = rows.view(1, 1, 1, -1).expand(1, *freqs_3.shape[1:])
        freqs = freqs_3.gather(0, index).squeeze(0)
    emb = torch.cat((freqs, freqs), dim=-1)
    out_dtype = dtype or inv_freq.dtype
    return emb.cos().to(out_dtype), emb.sin().to(out_dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def check_rope_inputs(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int:
    """Raise ValueError unless q [B, T, H, K], k [B, T, HKV, K] and cos/sin [B, T, rotary_dim] (even,
    <= K) fit together; returns rotary_dim."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q must be [B, T, H, K] and k [B, T, HKV, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    rotary_dim = cos.shape[-1]
    if cos.shape != sin.shape or cos.shape != (*q.shape[:2], rotary_dim) or rotary_dim > q.shape[-1] or rotary_dim % 2:
        raise ValueError(
            f"cos/sin must be [B, T, rotary_dim] with even rotary_dim <= K={q.shape[-1]} and "
            f"B, T = {tuple(q.shape[:2])}; got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    return rotary_dim


def apply_rotary_pos_emb_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first rotary_dim features of every q and k head (the dispatched `rope` op).

    Args:
        q: [B, T, H, K]; k: [B, T, HKV, K] (HKV any head count, e.g. GQA key/value heads).
        cos, sin: [B, T, rotary_dim], rotary_dim <= K and even, in q's dtype (see rope_cos_sin).
    Returns:
        q, k with the same shapes and dtypes; features past rotary_dim are unchanged.
    Raises:
        ValueError: shape mismatch.
    """
    rotary_dim = check_rope_inputs(q, k, cos, sin)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)

    def rotate(x):
        x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)

    return rotate(q), rotate(k)
