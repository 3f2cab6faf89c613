"""Wall-clock timing of a device call, shared by the op benches' tools (`ops/gdn/profile.py`) and the
`verl-moe bench` CLI: it sits in ops so that ops never import the tools above them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from .. import device


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
