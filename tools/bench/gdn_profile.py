"""Per-kernel device profile of the GDN bench cases (a tool for tuning; not part of the op).

`python -m verl_moe.tools.bench.gdn_profile [providers] [case ids]` (comma lists; default: triton, every
case of `ops/gdn.py`'s CASES). Per case, provider and mode: the median wall time of 10 synchronised calls after
3 warm-ups (as `verl-moe bench` times), the peak memory above the inputs, and the CUDA time of each
kernel averaged over 3 calls under torch.profiler. Prints one line per (case, provider, mode), then
the config each of our autotuned kernels picked.
"""

from __future__ import annotations

import functools
import gc
import sys

import torch

from ...ops import device
from .ops import gdn as bench
from .timing import time_ms


def _kernel_ms(fn, calls: int = 3) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        device.synchronize()
    out = {}
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if total:
            out[event.key] = total / calls / 1e3
    return out


def profile_cases(providers: list[str], case_ids: list[str]) -> None:
    dev = torch.device("cuda")
    for case_id in case_ids:
        case = next(c for c in bench.CASES if c["id"] == case_id)
        inputs = bench.make_inputs(case, dev)
        for provider in providers:
            for mode in bench.MODES:
                call = functools.partial(bench.run, provider, inputs, mode)
                for _ in range(3):
                    call()
                ms = time_ms(call, reps=10)
                device.synchronize()
                device.reset_peak_memory_stats()
                before = device.memory_stats()["allocated_gib"] * 2**30
                call()
                device.synchronize()
                peak = (device.max_memory_allocated() - before) / 2**30
                kernels = _kernel_ms(call)
                top = sorted(kernels.items(), key=lambda kv: -kv[1])[:14]
                print(
                    f"{case_id} {provider} {mode}: wall {ms:.3f} ms, kernels {sum(kernels.values()):.3f} ms, "
                    f"peak {peak:.2f} GiB | " + ", ".join(f"{name[:28]} {t:.3f}" for name, t in top),
                    flush=True,
                )
        del inputs
        device.empty_cache()


def print_autotune_picks() -> None:
    from triton.runtime.autotuner import Autotuner

    for obj in gc.get_objects():
        if isinstance(obj, Autotuner) and obj.cache and obj.base_fn.__module__.startswith("verl_moe."):
            print(obj.base_fn.__name__, {str(k[:5]): str(v) for k, v in obj.cache.items()}, flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    profile_cases(
        args[0].split(",") if args else ["triton"],
        args[1].split(",") if len(args) > 1 else [c["id"] for c in bench.CASES],
    )
    print_autotune_picks()
