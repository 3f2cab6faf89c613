"""Packed-sequence (varlen) helpers shared by every sequence op.

A packed row's offsets `cu_seqlens` [N+1] live where the kernels read them (the device); the ops
also need them on the host (validation, per-sequence loops, chunk plans, flash attention's longest
sequence). Reading a device tensor back waits for all queued device work, so a caller that has the
offsets on the host passes that copy too, as `cu_seqlens_cpu` (fla's name; `HostOffsets`): the
engines' packed batch carries both (`engines/batch.py::PackedBatch`). Without it an op reads `cu_seqlens` itself,
once per call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .device import to_device

# The host copy of a packed row's offsets: ints (what the engines' packed batch carries: a tuple is no
# tensor, so FSDP's input moves and activation offload leave it on the host) or a CPU tensor (fla's type).
HostOffsets = Sequence[int] | torch.Tensor


def host_values(cu_seqlens: torch.Tensor, cu_seqlens_cpu: HostOffsets | None = None) -> list[int]:
    """The offsets as host ints: from `cu_seqlens_cpu` (the host copy of the same offsets: the
    caller's promise, only its length is checked) when given, else read from `cu_seqlens`."""
    if cu_seqlens_cpu is None:
        return cu_seqlens.tolist()
    if isinstance(cu_seqlens_cpu, torch.Tensor):
        if cu_seqlens_cpu.device.type != "cpu":
            raise ValueError(f"cu_seqlens_cpu must be on the host, got a tensor on {cu_seqlens_cpu.device}")
        values = cu_seqlens_cpu.tolist()
    else:
        values = list(cu_seqlens_cpu)
    if len(values) != cu_seqlens.numel():
        raise ValueError(
            f"cu_seqlens_cpu must be a host copy of cu_seqlens [{cu_seqlens.numel()}], got {len(values)} offsets"
        )
    return values


def host_offsets(cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: HostOffsets | None) -> HostOffsets | None:
    """The host copy of `cu_seqlens`: `cu_seqlens_cpu` when given, else the device tensor read once
    (as a tuple), so an op that needs the values more than once waits for the device at most once."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens_cpu is not None:
        return cu_seqlens_cpu  # no offsets, or not a tensor (the op's check names the problem)
    return tuple(cu_seqlens.tolist())


def offsets_tensor(values, device: torch.device) -> torch.Tensor:
    """int32 offsets `values` (host ints) on `device`, copied without waiting for queued device work."""
    return to_device(torch.tensor(list(values), dtype=torch.int32), device)


def check_cu_seqlens(
    cu_seqlens: torch.Tensor, total_tokens: int, cu_seqlens_cpu: HostOffsets | None = None
) -> list[int]:
    """Raise ValueError unless `cu_seqlens` is a 1-D int32/int64 tensor [N+1], starting at 0,
    non-decreasing, and ending at `total_tokens`; its values are read from `cu_seqlens_cpu` when
    given (`host_values`). Returns them, as host ints."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens must be a tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    values = host_values(cu_seqlens, cu_seqlens_cpu)
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {values[0]}")
    if any(b < a for a, b in zip(values[:-1], values[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {values}")
    if values[-1] != total_tokens:
        raise ValueError(f"cu_seqlens ends at {values[-1]} but the packed input has {total_tokens} tokens")
    return values


def seq_bounds(
    cu_seqlens: torch.Tensor | None, total_tokens: int, cu_seqlens_cpu: HostOffsets | None = None
) -> list[tuple[int, int]]:
    """[(start, end), ...] per sequence; one sequence covering everything when cu_seqlens is None."""
    if cu_seqlens is None:
        return [(0, total_tokens)]
    values = host_values(cu_seqlens, cu_seqlens_cpu)
    return list(zip(values[:-1], values[1:]))


def sequence_starts(
    B: int, T: int, cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: HostOffsets | None, device
) -> torch.Tensor:
    """[B * T] int64: for each token of B rows of T (one packed row with cu_seqlens, else B sequences),
    the flat index of its sequence's first token."""
    start = torch.empty(B * T, dtype=torch.long)
    for b in range(B):
        for s, e in seq_bounds(cu_seqlens, T, cu_seqlens_cpu):
            start[b * T + s : b * T + e] = b * T + s
    return to_device(start, device)
