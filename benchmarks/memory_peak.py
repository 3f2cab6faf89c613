"""What is alive at the peak of one training step of the bench's reduced Qwen3.5-MoE (CUDA).

    python benchmarks/memory_peak.py TOKENS [--offload] [--units layer|tiles] [--json F]

Records the CUDA allocator's history (python stacks) over one checkpointed forward + log-prob loss +
backward, replays it to the moment of the highest allocated total, and groups the blocks alive then by
the innermost frame inside the verl_moe package (file:line function), largest first, in GiB and bytes
per token.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

import torch
from verl_moe.tools.bench import model as bench

# the package's root (a checkout's root, or site-packages/verl_moe): frames under it are ours
REPO = os.path.dirname(os.path.dirname(os.path.abspath(bench.__file__)))


def where(frames) -> str:
    for f in frames:
        name = f.get("filename", "")
        if name.startswith(REPO) and "memory_peak" not in name:
            return f"{os.path.relpath(name, REPO)}:{f['line']} {f['name']}"
    return "(outside verl_moe)"


def peak_composition(snapshot) -> tuple[int, dict, list[str]]:
    """(the highest total allocated in the recorded window, what was alive then by site, the last repo
    sites allocated before it: where in the step the peak is)."""
    live, total, best, best_live, recent, best_recent = {}, 0, -1, {}, [], []
    for trace in snapshot["device_traces"]:
        for e in trace:
            if e["action"] == "alloc":
                site = where(e.get("frames", []))
                live[e["addr"]] = (e["size"], site)
                total += e["size"]
                if site != "(outside verl_moe)" and (not recent or recent[-1] != site):
                    recent = (recent + [site])[-6:]
            elif e["action"] in ("free_requested",) and e["addr"] in live:
                total -= live.pop(e["addr"])[0]
            if total > best:
                best, best_live, best_recent = total, dict(live), list(recent)
    groups = defaultdict(int)
    for size, site in best_live.values():
        groups[site] += size
    return best, dict(sorted(groups.items(), key=lambda kv: -kv[1])), best_recent


def main():
    p = argparse.ArgumentParser()
    p.add_argument("tokens", type=int)
    p.add_argument("--offload", action="store_true")
    p.add_argument("--units", choices=("layer", "tiles"), help="checkpoint units (default: tiles with --offload)")
    p.add_argument("--json")
    a = p.parse_args()
    case = {"id": "memory", "layers": 8, "tokens": a.tokens, "checkpoint": True, "offload": a.offload}
    if a.units:
        case["checkpoint_units"] = a.units
    inputs = bench.make_inputs(case, torch.device("cuda"))
    bench.run("ours", inputs, "fwd_bwd")  # warm-up: autotune, compile
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
    bench.run("ours", inputs, "fwd_bwd")
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated()
    replay_peak, groups, before_peak = peak_composition(snapshot)
    GiB, T = 1024**3, a.tokens
    print(
        f"T={T} offload={a.offload} units={a.units or 'default'}: before the step {base / GiB:.2f} GiB, "
        f"peak {peak / GiB:.2f} GiB, "
        f"the step's extra peak {(peak - base) / GiB:.2f} GiB ({(peak - base) / T / 1024:.1f} KiB/token)"
    )
    print(f"alive at the replayed peak ({replay_peak / GiB:.2f} GiB of blocks allocated in the step):")
    for site, size in list(groups.items())[:30]:
        print(f"  {size / GiB:8.3f} GiB {size / T / 1024:8.1f} KiB/token  {site}")
    print("the last repo allocations before the peak:", " <- ".join(reversed(before_peak)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "tokens": T,
                    "offload": a.offload,
                    "units": a.units,
                    "base": base,
                    "peak": peak,
                    "replay_peak": replay_peak,
                    "groups": groups,
                    "before_peak": before_peak,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
