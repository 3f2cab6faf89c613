"""The one place that knows which accelerator this process runs on.

Nothing else in verl_moe calls `torch.cuda` / `torch.npu` directly: ask here for the device
type, its torch module, the collective backend, and for synchronize / memory statistics.
"""

from __future__ import annotations

import functools
import os

import torch

# deterministic mode lives with the ops' other process-wide state; re-exported for callers of device
from .common.runtime import DETERMINISTIC_ENV, deterministic  # noqa: F401

# Ascend: torch_npu must be imported before torch knows the "npu" device. Importing it on a
# machine without CANN fails (libhccl.so), so a failed import simply means "no NPU".


@functools.lru_cache(maxsize=1)
def _npu_available() -> bool:
    if os.environ.get("VERL_MOE_DISABLE_NPU") == "1":
        return False
    try:
        import torch_npu  # noqa: F401
    except Exception:
        return False
    return bool(torch.npu.is_available())


@functools.lru_cache(maxsize=1)
def device_type() -> str:
    """`"cuda"`, `"npu"` or `"cpu"`; `VERL_MOE_DEVICE` overrides the probe."""
    forced = os.environ.get("VERL_MOE_DEVICE")
    if forced:
        if forced not in ("cuda", "npu", "cpu"):
            raise ValueError(f"VERL_MOE_DEVICE={forced!r}: expected one of cuda, npu, cpu")
        return forced
    if torch.cuda.is_available():
        return "cuda"
    if _npu_available():
        return "npu"
    return "cpu"


def is_accelerator(device: torch.device | str | None = None) -> bool:
    """True when `device` (default: this process's device type) is cuda or npu."""
    kind = device_type() if device is None else torch.device(device).type
    return kind in ("cuda", "npu")


def device_module():
    """`torch.cuda`, `torch.npu` or `torch.cpu` for this process."""
    return getattr(torch, device_type())


def capturing() -> bool:
    """True while this process's current device stream is being captured into a graph (value checks
    that read a tensor back to the host must not run then)."""
    probe = getattr(device_module(), "is_current_stream_capturing", None)
    return bool(probe()) if probe is not None and is_accelerator() else False


def dist_backend() -> str:
    """Collective backend for this device type: nccl, hccl or gloo."""
    return {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}[device_type()]


def current_device() -> torch.device:
    """The device this rank computes on (`cpu`, or the local accelerator index)."""
    kind = device_type()
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, device_module().current_device())


def set_device(local_rank: int) -> None:
    if device_type() != "cpu":
        device_module().set_device(local_rank)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` (a tensor in host memory) on `device`, copied without making the host wait: a copy from pageable
    memory waits until the device has run all the work queued before it, one from pinned memory is queued like
    a kernel (the pinned block is not reused before the copy has run). On cpu, `host` itself."""
    if torch.device(device).type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def synchronize() -> None:
    if device_type() != "cpu":
        device_module().synchronize()


def empty_cache() -> None:
    if device_type() != "cpu":
        device_module().empty_cache()


def manual_seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    if device_type() != "cpu":
        device_module().manual_seed_all(seed)


def reset_peak_memory_stats() -> None:
    if device_type() != "cpu":
        device_module().reset_peak_memory_stats()


def memory_stats() -> dict[str, float]:
    """Allocated / reserved / peak-allocated memory in GiB (zeros on CPU, which has no allocator stats)."""
    if device_type() == "cpu":
        return {"allocated_gib": 0.0, "reserved_gib": 0.0, "max_allocated_gib": 0.0}
    mod = device_module()
    gib = 1024**3
    return {
        "allocated_gib": mod.memory_allocated() / gib,
        "reserved_gib": mod.memory_reserved() / gib,
        "max_allocated_gib": mod.max_memory_allocated() / gib,
    }


def shared_memory_per_block() -> int:
    """Bytes of shared memory one kernel block may use on the current cuda device (its opt-in maximum);
    0 elsewhere (cpu, npu: callers fall back to their smallest tiles)."""
    if device_type() != "cuda":
        return 0
    return _cuda_shared_memory(torch.cuda.current_device())


@functools.cache
def _cuda_shared_memory(index: int) -> int:
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


def max_memory_allocated() -> int:
    """Peak allocated bytes on the accelerator (0 on CPU)."""
    return 0 if device_type() == "cpu" else device_module().max_memory_allocated()
