"""Profile one training step of the reduced Qwen3.5-MoE (ours) on a GPU: top CUDA kernels and their share, then
the host gaps: the time the device sat idle between kernels, by what the host was doing (a sync that waited for
the device, the allocator, or host work before the next launch, named by the op that launched it).

python benchmarks/profile_step.py [tokens] [sequences] [--trace FILE]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ")
ALLOCATOR = ("cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaMallocHost")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def _innermost(ops: list[dict], t: float) -> dict | None:
    """The shortest CPU op enclosing time t (ops of one thread nest)."""
    enclosing = [o for o in ops if o["ts"] <= t <= o["ts"] + o["dur"]]
    return min(enclosing, key=lambda o: o["dur"]) if enclosing else None


def _outermost(ops: list[dict], t: float) -> dict | None:
    enclosing = [o for o in ops if o["ts"] <= t <= o["ts"] + o["dur"] and not o["name"].startswith("ProfilerStep")]
    return max(enclosing, key=lambda o: o["dur"]) if enclosing else None


def host_gaps(trace: dict, min_gap_us: float = 2.0, package_root: str | None = None) -> list[tuple[str, float, int]]:
    """From a torch profiler chrome trace of one step: the device's idle intervals between its first and last
    kernel (longer than `min_gap_us`), each put down to a cause: "sync: <op>" when the host waited for the device
    in a synchronising call during the gap (the op that called it: `aten::item`, `aten::nonzero`, ...),
    "allocator: <op>" when it was in cudaMalloc / cudaFree, else "launch: <op> in <outer op>" for host work
    before the next kernel's launch (the kernel's name where no aten op launched it: our Triton kernels'
    Python wrappers). With Python stacks in the trace and `package_root`, each cause also names the innermost
    frame of our code there (" at ops/gdn/chunk.py(210): forward"). Returns (cause, idle ms, gaps) sorted by
    idle time."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    launches = {e["args"]["correlation"]: e for e in runtime if "correlation" in e.get("args", {})}
    ops_by_thread: dict = defaultdict(list)  # the forward's ops and the autograd thread's nest separately
    ours_by_thread: dict = defaultdict(list)  # Python frames of our code
    for e in events:
        if e.get("cat") == "cpu_op":
            ops_by_thread[e["tid"]].append(e)
        elif e.get("cat") == "python_function" and package_root and e["name"].startswith(package_root):
            ours_by_thread[e["tid"]].append(e)

    def frame(event: dict) -> str:
        inner = _innermost(ours_by_thread[event["tid"]], event["ts"])
        return f" at {inner['name'][len(package_root) :].lstrip('/')}" if inner else ""

    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    busy_end = device[0]["ts"] + device[0]["dur"] if device else 0.0
    for kernel in device[1:]:
        start, gap = kernel["ts"], kernel["ts"] - busy_end
        if gap > min_gap_us:
            launch = launches.get(kernel.get("args", {}).get("correlation"))
            launch_ts = launch["ts"] if launch else start
            waits = [e for e in runtime if e["name"].startswith(SYNCS) and busy_end - e["dur"] <= e["ts"] <= launch_ts]
            allocs = [e for e in runtime if e["name"].startswith(ALLOCATOR) and busy_end <= e["ts"] + e["dur"]]
            allocs = [e for e in allocs if e["ts"] <= launch_ts]
            if waits:
                op = _innermost(ops_by_thread[waits[-1]["tid"]], waits[-1]["ts"])
                cause = f"sync: {op['name'] if op else waits[-1]['name']}{frame(waits[-1])}"
            elif allocs:
                op = _innermost(ops_by_thread[allocs[-1]["tid"]], allocs[-1]["ts"])
                cause = f"allocator: {op['name'] if op else allocs[-1]['name']}"
            else:
                ops = ops_by_thread[launch["tid"]] if launch else []
                inner, outer = _innermost(ops, launch_ts), _outermost(ops, launch_ts)
                # a Triton kernel launched from Python outside any aten op: named by the kernel
                where = inner["name"] if inner else f"{kernel['name'][:60]} (outside aten ops)"
                if outer is not None and outer is not inner:
                    where += f" in {outer['name']}"
                cause = f"launch: {where}{frame(launch) if launch else ''}"
            totals[cause][0] += gap / 1e3
            totals[cause][1] += 1
        busy_end = max(busy_end, start + kernel["dur"])
    return sorted(((c, ms, n) for c, (ms, n) in totals.items()), key=lambda x: -x[1])


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from verl_moe.tools.bench import model as bench

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokens", type=int, nargs="?", default=8192)
    parser.add_argument("sequences", type=int, nargs="?", default=1)
    parser.add_argument("--trace", help="also keep the chrome trace here")
    args = parser.parse_args()
    case = {"id": "profile", "layers": 8, "tokens": args.tokens, "sequences": args.sequences}
    inputs = bench.make_inputs(case, torch.device("cuda"))
    for _ in range(3):
        bench.run("ours", inputs, "fwd_bwd")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        bench.run("ours", inputs, "fwd_bwd")
        torch.cuda.synchronize()
    print(f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events)
    print(f"CUDA kernel time {total / 1e3:.1f} ms over {sum(e.count for e in events)} kernels")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:40]:
        print(f"{e.self_device_time_total / 1e3:8.2f} ms {e.count:5d}x  {e.key[:110]}")
    path = args.trace or os.path.join(tempfile.mkdtemp(), "step.json")
    prof.export_chrome_trace(path)
    package_root = str(Path(importlib.import_module("verl_moe.ops").__file__).resolve().parents[1])
    with open(path) as f:
        gaps = host_gaps(json.load(f), package_root=package_root)
    print(f"device idle between kernels: {sum(ms for _, ms, _ in gaps):.2f} ms in {sum(n for *_, n in gaps)} gaps")
    for cause, ms, n in gaps[:30]:
        print(f"{ms:8.2f} ms {n:5d}x  {cause[:150]}")


if __name__ == "__main__":
    main()
