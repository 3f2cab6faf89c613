"""Where exact mode's time goes against fast mode on a GPU: per mode, the kernels of one training step
(forward, then backward) and of a whole decode, grouped by kernel name, on the reduced Qwen3.5-MoE of
`verl-moe bench exact` with its RL-shaped requests.

python benchmarks/profile_exact.py [requests] [layers] [modes, default fast,exact] > profile.txt
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile
from verl_moe.ops.logprob import logprob_head
from verl_moe.tools.bench import exact as eb

requests = int(sys.argv[1]) if len(sys.argv) > 1 else 256
layers = int(sys.argv[2]) if len(sys.argv) > 2 else 4
dev = torch.device("cuda")
model, fast_ops, exact_ops, reqs = eb.reduced_setup(requests, layers)
ops = {"fast": fast_ops, "exact": exact_ops}


def table(prof, title, per=1):
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events)
    print(f"\n### {title}: kernels {total / 1e3 / per:.2f} ms over {sum(e.count for e in events) / per:.0f} launches")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:22]:
        print(f"{e.self_device_time_total / 1e3 / per:9.3f} ms {e.count / per:7.1f}x  {e.key[:100]}")


def profile_mode(mode):
    eb.use_ops(model, ops[mode])
    head = logprob_head("exact") if mode == "exact" else logprob_head()
    eb._generate(model, reqs)  # warm: compiles, captures
    prefill_s, decode_s, completions = eb._generate(model, reqs)
    steps = max(r.params.max_tokens for r in reqs) - 1
    print(f"\n## {mode}: prefill {prefill_s * 1e3:.1f} ms, decode {decode_s / steps * 1e3:.3f} ms/step")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eb._generate(model, reqs)
        torch.cuda.synchronize()
    table(prof, f"{mode} generate (prefill + {steps} decode steps), per decode step", per=steps)
    sequences = [list(r.prompt_ids) + c.token_ids for r, c in zip(reqs, completions)]
    group = eb._micro_batches([len(s) for s in sequences], 16384)[0]
    ids, pos, cu, cu_cpu, labels = eb._packed(sequences, group, dev)
    inv_t = torch.ones(labels.shape[0], device=dev)

    def forward():
        hidden = model(ids, pos, cu, cu_seqlens_cpu=cu_cpu).last_hidden_state[0]
        return head(hidden, model.lm_head.weight, labels, inv_t, calculate_entropy=False)[0]

    for _ in range(2):
        (-forward().mean()).backward()
        model.zero_grad(set_to_none=True)
    with torch.no_grad():
        fwd_ms = eb._seconds(forward)[0] * 1e3
    loss = -forward().mean()
    bwd_ms = eb._seconds(loss.backward)[0] * 1e3
    model.zero_grad(set_to_none=True)
    print(f"{mode} train: forward (no grad) {fwd_ms:.1f} ms, backward {bwd_ms:.1f} ms")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        loss = -forward().mean()
        torch.cuda.synchronize()
    table(prof, f"{mode} train forward (grad on)")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        loss.backward()
        torch.cuda.synchronize()
    table(prof, f"{mode} train backward")
    model.zero_grad(set_to_none=True)


for mode in (sys.argv[3] if len(sys.argv) > 3 else "fast,exact").split(","):
    profile_mode(mode)
