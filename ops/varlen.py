"""Packed-sequence (varlen) helpers shared by every sequence op."""

from __future__ import annotations

import torch


def check_cu_seqlens(cu_seqlens: torch.Tensor, total_tokens: int) -> None:
    """Raise ValueError unless `cu_seqlens` is a 1-D int32/int64 tensor [N+1], starting at 0,
    non-decreasing, and ending at `total_tokens`."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens must be a tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    values = cu_seqlens.tolist()
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {values[0]}")
    if any(b < a for a, b in zip(values[:-1], values[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {values}")
    if values[-1] != total_tokens:
        raise ValueError(f"cu_seqlens ends at {values[-1]} but the packed input has {total_tokens} tokens")


def seq_bounds(cu_seqlens: torch.Tensor | None, total_tokens: int) -> list[tuple[int, int]]:
    """[(start, end), ...] per sequence; one sequence covering everything when cu_seqlens is None."""
    if cu_seqlens is None:
        return [(0, total_tokens)]
    values = cu_seqlens.tolist()
    return list(zip(values[:-1], values[1:]))
