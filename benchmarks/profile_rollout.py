"""Profile our rollout's decode step on a GPU: the kernels of one captured step (device graphs, as the
engine runs by default on CUDA) and their share, at the rollout bench's shapes (reduced Qwen3.5-MoE with 4
layers, vocabulary 248,320, bf16, 256 prompts of 128 random tokens, temperature 1, log-probs on).

python benchmarks/profile_rollout.py [sequences] [steps]
"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from verl_moe.engines.rollout.engine import GenerationEngine, Request
from verl_moe.engines.rollout.sampling import SamplingParams
from verl_moe.models import build
from verl_moe.tools.bench.model import reduced_config

sequences = int(sys.argv[1]) if len(sys.argv) > 1 else 256
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 64
torch.manual_seed(0)
config = reduced_config(4)
model = build(config, dtype=torch.bfloat16, device=torch.device("cuda")).eval()
engine = GenerationEngine(model, [], seed=0, max_num_seqs=sequences, device_graphs=True)
params = SamplingParams(max_tokens=steps + 48, temperature=1.0, logprobs=True, ignore_eos=True)
gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, config.vocab_size, (128,), generator=gen).tolist() for _ in range(sequences)]
engine.add([Request(f"r{i}", p, params) for i, p in enumerate(prompts)])
engine.step(40)  # captures, compiles and autotunes
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    start = time.perf_counter()
    engine.step(steps)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
total = sum(e.self_device_time_total for e in events) / 1e3 / steps
kernels = sum(e.count for e in events) / steps
print(f"{sequences} sequences: {wall_ms:.3f} ms per step (profiled); kernels {total:.3f} ms, {kernels:.0f} per step")
for e in sorted(events, key=lambda e: -e.self_device_time_total)[:30]:
    print(f"{e.self_device_time_total / 1e3 / steps:8.4f} ms {e.count / steps:6.1f}x  {e.key[:110]}")
