"""Wall-clock and kernel timing of a device call, shared by `verl-moe bench` and the GDN kernel profile
(`gdn_profile.py`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from ...ops import device


def time_ms(fn: Callable[[], object], reps: int) -> float:
    """Median wall time in ms of `reps` synchronised calls of `fn`."""
    times = []
    for _ in range(reps):
        device.synchronize()
        start = time.perf_counter()
        fn()
        device.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def kernel_ms(fn, reps: int) -> float:
    """Device time in ms per call of `fn`: the sum of its kernels' durations under the torch profiler
    (CUDA only; NaN elsewhere). Unlike `time_ms` it leaves out the host's launch and autograd path,
    which dominates sub-millisecond ops timed alone but overlaps the GPU's work inside a training
    step (where the GPU is busy nearly all the time)."""
    if device.device_type() != "cuda":
        return float("nan")
    from torch.profiler import ProfilerActivity, profile

    device.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        device.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / reps
