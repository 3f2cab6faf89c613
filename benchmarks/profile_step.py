"""Profile one training step of the reduced Qwen3.5-MoE (ours) on a GPU: top CUDA kernels and their share.

python benchmarks/profile_step.py [tokens] [sequences]
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile
from verl_moe.models import train_step_bench as bench

tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
sequences = int(sys.argv[2]) if len(sys.argv) > 2 else 1
case = {"id": "profile", "layers": 8, "tokens": tokens, "sequences": sequences}
inputs = bench.make_inputs(case, torch.device("cuda"))
for _ in range(3):
    bench.run("ours", inputs, "fwd_bwd")
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    bench.run("ours", inputs, "fwd_bwd")
    torch.cuda.synchronize()
print(f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
total = sum(e.self_device_time_total for e in events)
print(f"CUDA kernel time {total / 1e3:.1f} ms over {sum(e.count for e in events)} kernels")
for e in sorted(events, key=lambda e: -e.self_device_time_total)[:40]:
    print(f"{e.self_device_time_total / 1e3:8.2f} ms {e.count:5d}x  {e.key[:110]}")
