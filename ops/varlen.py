"""Packed-sequence (varlen) helpers shared by every sequence op."""

from __future__ import annotations

import weakref

import torch

from .common.runtime import HOST_OFFSETS, HOST_OFFSETS_LIMIT


def _read_is_costly(cu_seqlens: torch.Tensor) -> bool:
    """A device tensor's read is a device-to-host copy that waits for all queued device work; a CPU
    tensor's is a plain list conversion."""
    return cu_seqlens.device.type != "cpu"


def host_values(cu_seqlens: torch.Tensor) -> list[int]:
    """`cu_seqlens.tolist()`: always the tensor's current content.

    CPU offsets are read on every call: their memory can change without torch seeing it (a numpy
    array behind `torch.from_numpy` rewritten in place keeps the version counter). Device offsets
    are read once per tensor object, version and storage: one packed batch's offsets reach every
    layer's ops and the model's own check, and each read waits for all queued device work. On a
    device only torch ops write (each bumps the version); a write that bypasses the version
    counter (through `.data`, or a kernel handed the raw pointer) is not seen. The cache is
    `ops/common/runtime.py`'s `HOST_OFFSETS`."""
    if not _read_is_costly(cu_seqlens) or cu_seqlens.is_inference():  # inference: no version counter
        return cu_seqlens.tolist()
    stamp = (cu_seqlens._version, cu_seqlens.data_ptr())
    seen = HOST_OFFSETS.get(id(cu_seqlens))
    if seen is not None and seen[0]() is cu_seqlens and seen[1] == stamp:
        return seen[2]
    values = cu_seqlens.tolist()
    _remember(cu_seqlens, stamp, values)
    return values


def _remember(cu_seqlens: torch.Tensor, stamp: tuple[int, int], values: list[int]) -> None:
    if len(HOST_OFFSETS) >= HOST_OFFSETS_LIMIT:
        for key in [key for key, entry in HOST_OFFSETS.items() if entry[0]() is None]:
            del HOST_OFFSETS[key]  # offsets of batches (or tiles) already freed
        if len(HOST_OFFSETS) >= HOST_OFFSETS_LIMIT:
            HOST_OFFSETS.clear()
    HOST_OFFSETS[id(cu_seqlens)] = (weakref.ref(cu_seqlens), stamp, values)


def offsets_tensor(values, device: torch.device) -> torch.Tensor:
    """int32 offsets `values` (host ints) on `device`, copied without waiting for queued device work, and
    known to `host_values` (no device read later)."""
    host = torch.tensor(list(values), dtype=torch.int32)
    if torch.device(device).type == "cpu":
        return host
    offsets = host.pin_memory().to(device, non_blocking=True)
    _remember(offsets, (offsets._version, offsets.data_ptr()), list(values))
    return offsets


def check_cu_seqlens(cu_seqlens: torch.Tensor, total_tokens: int) -> None:
    """Raise ValueError unless `cu_seqlens` is a 1-D int32/int64 tensor [N+1], starting at 0,
    non-decreasing, and ending at `total_tokens`."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens must be a tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    values = host_values(cu_seqlens)
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
    values = host_values(cu_seqlens)
    return list(zip(values[:-1], values[1:]))
