"""Where a speculative round's time goes against a plain decode step: the reduced Qwen3.5-MoE of
`benchmarks/mtp_bench.py` (4 layers, one MTP layer, vocabulary 32,768, bf16; random weights: a round's cost
does not depend on what it accepts, only the tokens it yields do), per request count:

- captured (device graphs, as the engines run on cuda): ms and kernels per plain step and per round (k drafts);
- eager, each stage of the round under its own profiler range: the MTP layer (catch-up and draft steps), the
  head (drafts and targets), the verification pass, the acceptance rules and the commit, by device time.

python benchmarks/profile_speculative.py [requests, default 1,8] [k, default 2]
python benchmarks/profile_speculative.py --tiny 1,4 2      # the tiny model on CPU (eager only): a smoke run
"""

import os
import sys
from functools import partial

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import verl_moe.engines.rollout.speculative as speculative  # noqa: E402
import verl_moe.models as vm  # noqa: E402
from mtp_bench import model_config  # noqa: E402
from verl_moe.engines.rollout.engine import GenerationEngine, Request  # noqa: E402
from verl_moe.engines.rollout.sampling import SamplingParams  # noqa: E402
from verl_moe.ops import device  # noqa: E402
from verl_moe.tools.bench.timing import time_ms  # noqa: E402

args = [a for a in sys.argv[1:] if a != "--tiny"]
tiny = "--tiny" in sys.argv
counts = [int(n) for n in (args[0] if args else "1,8").split(",")]
k = int(args[1]) if len(args) > 1 else 2
dev = device.current_device() if device.is_accelerator() else torch.device("cpu")
activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
torch.manual_seed(0)
model = vm.build(model_config(tiny, 32768), dtype=torch.bfloat16, device=dev).eval().requires_grad_(False)


def requests(n: int, tag: str) -> list[Request]:
    gen = torch.Generator().manual_seed(n)
    params = SamplingParams(max_tokens=512, temperature=1.0, ignore_eos=True, logprobs=True)
    prompts = [tuple(torch.randint(1, 4000, (32,), generator=gen).tolist()) for _ in range(n)]
    return [Request(f"{tag}{i}", p, params) for i, p in enumerate(prompts)]


def kernels_per_call(fn, repeats: int) -> float:
    """Device kernels launched per call of fn (cuda)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        device.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA") / repeats


def ranged(obj, name: str, label: str) -> None:
    """Wrap obj.name in a profiler range called label (the eager breakdown)."""
    inner = getattr(obj, name)

    def wrapper(*a, **kw):
        with record_function(label):
            return inner(*a, **kw)

    setattr(obj, name, wrapper)


# shared by every engine: wrapped once (a range outside a profile costs next to nothing)
ranged(model, "logits", "head")
ranged(speculative, "accept_drafts", "accept")
ranged(speculative, "accept_greedy", "accept")

for n in counts:
    graphs = dev.type == "cuda"
    plain = GenerationEngine(model, [], seed=0, max_num_seqs=n, device_graphs=graphs)
    spec = speculative.SpeculativeEngine(model, [], num_draft_tokens=k, max_num_seqs=n, device_graphs=graphs)
    plain.add(requests(n, "p"))
    spec.add(requests(n, "s"))
    plain.step(8)  # captures, compiles and autotunes
    spec.step(8)
    step_ms, round_ms = time_ms(partial(plain.step, 1), 20), time_ms(partial(spec.step, 1), 20)
    line = f"{n} requests, k={k}: plain step {step_ms:.3f} ms, round {round_ms:.3f} ms ({round_ms / step_ms:.2f} steps)"
    if graphs:
        line += f"; kernels {kernels_per_call(partial(plain.step, 1), 5):.0f} per step, "
        line += f"{kernels_per_call(partial(spec.step, 1), 5):.0f} per round"
    print(line, flush=True)
    # the eager round by stage
    eager = speculative.SpeculativeEngine(model, [], num_draft_tokens=k, max_num_seqs=n, device_graphs=False)
    eager.add(requests(n, "e"))
    eager.step(2)
    ranged(eager.drafter, "step", "mtp layer")
    ranged(eager.decoder, "verify", "verify")
    ranged(eager.decoder, "commit", "commit")
    ranged(eager, "uniforms", "uniforms")
    with profile(activities=activities) as prof:
        for _ in range(5):
            eager.step(1)
        device.synchronize()
    stages = {}
    for e in prof.key_averages():
        if e.key in ("mtp layer", "head", "verify", "commit", "accept", "uniforms"):
            ms = (e.device_time_total if dev.type == "cuda" else e.cpu_time_total) / 1e3 / 5
            stages[e.key] = (ms, e.count / 5)
    what = "device" if dev.type == "cuda" else "cpu"
    print(
        f"  eager round by stage ({what} ms, calls per round): "
        + ", ".join(f"{key} {ms:.3f} ({c:.0f}x)" for key, (ms, c) in sorted(stages.items(), key=lambda x: -x[1][0])),
        flush=True,
    )
    for engine in (plain, spec, eager):
        engine.abort_all()
