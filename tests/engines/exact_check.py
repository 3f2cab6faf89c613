"""Exact mode's property, checked in a process of its own (exact mode on cpu needs `ATEN_CPU_CAPABILITY=default`,
set before torch loads): our rollout engine generates for many requests, and the trainer's view of the same
sequences (the packed forward and the log-prob head, packed as verl's dynamic batching packs micro-batches)
gives every response token the rollout's log-prob, bitwise.

`python exact_check.py [--device cuda] FAMILY DTYPE [OP ...]` prints one JSON line per run: the exact model as
built, then the same model with each named op switched back to its fast form (the torch form on cpu, the
device's default elsewhere): {"switched": op, "tokens": n, "mismatched": tokens whose log-probs differ,
"max_abs_diff": ...}. Used by `test_exact_rollout.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
import verl_moe.models as vm  # noqa: E402
from tiny_models import randomize_norms, tiny_qwen3_5_moe_text, tiny_qwen3_moe  # noqa: E402
from verl_moe.engines.rollout.engine import GenerationEngine, Request  # noqa: E402
from verl_moe.engines.rollout.sampling import SamplingParams  # noqa: E402
from verl_moe.ops import resolve  # noqa: E402
from verl_moe.ops.linear import linear_ref  # noqa: E402
from verl_moe.ops.logprob import logprob_head  # noqa: E402

FAMILIES = {"qwen3_5_moe": tiny_qwen3_5_moe_text, "qwen3_moe": tiny_qwen3_moe}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MAX_PREFILL_TOKENS = 8  # prompts run to 13 tokens: the longer ones are prefilled in chunks
# ResolvedOps field -> its fast form on cpu (the field's op resolved as "torch")
FAST = {
    "linear": "linear",
    "attention": "attention",
    "attention_decode": "attention.decode",
    "attention_cached": "attention.cached",
    "gdn": "gdn",
    "gdn_step": "gdn.step",
    "conv1d": "conv1d",
    "router": "router",
    "experts": "experts",
    "sampling": "sampling",
}


def requests(n: int = 18) -> list[Request]:
    """Prompt lengths 1..13 (past MAX_PREFILL_TOKENS), temperatures 1 and 0.7, 3..9 new tokens."""
    g = torch.Generator().manual_seed(1)
    return [
        Request(
            f"r{i}",
            tuple(torch.randint(2, 128, (1 + (i * 5) % 13,), generator=g).tolist()),
            SamplingParams(max_tokens=3 + i % 7, temperature=(1.0, 0.7)[i % 2], logprobs=True),
        )
        for i in range(n)
    ]


def generate(model, reqs: list[Request]):
    """Two waves: the first 10 requests, a few steps, then the rest joining the running batch."""
    engine = GenerationEngine(model, eos_token_ids=[1], seed=3, max_prefill_tokens=MAX_PREFILL_TOKENS, max_num_seqs=32)
    done = {c.request_id: c for c in engine.add(reqs[:10])}
    done.update((c.request_id, c) for c in engine.step(2))
    done.update((c.request_id, c) for c in engine.add(reqs[10:]))
    while engine.num_running:
        done.update((c.request_id, c) for c in engine.step(4))
    return [done[r.request_id] for r in reqs]


def trainer_log_probs(model, head, sequences, temperatures, micro_batches, device="cpu") -> list[torch.Tensor]:
    """Per sequence, the log-prob of each token after the first as the trainer computes it: the packed forward
    of each micro-batch (lists of sequence indices) and the log-prob head at 1 / temperature."""
    out = {}
    for group in micro_batches:
        seqs = [sequences[n] for n in group]
        ids = torch.tensor([t for s in seqs for t in s])[None]
        pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
        cu = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()], dtype=torch.int32)
        labels = torch.cat([torch.tensor(s[1:] + [0]) for s in seqs])
        inv_t = torch.cat([1.0 / torch.full((len(sequences[n]),), temperatures[n]) for n in group])
        cu_cpu = cu.tolist()
        ids, pos, cu, labels, inv_t = (t.to(device) for t in (ids, pos, cu, labels, inv_t))
        with torch.no_grad():
            hidden = model(ids, pos, cu, cu_seqlens_cpu=cu_cpu).last_hidden_state[0]
            log_probs, _ = head(hidden, model.lm_head.weight, labels, inv_t, calculate_entropy=False)
        for n, a, b in zip(group, cu[:-1].tolist(), cu[1:].tolist()):
            out[n] = log_probs[a : b - 1].cpu()
    return [out[n] for n in range(len(sequences))]


def packings(n: int) -> list[list[list[int]]]:
    """Micro-batch splits as verl's dynamic batching makes them (shuffled order, uneven groups), and all in one."""
    order = list(range(n))
    random.Random(0).shuffle(order)
    return [[list(range(n))], [order[:1], order[1:4], order[4:9], order[9:]], [[i] for i in reversed(range(n))]]


def switched(model, field: str | None, device: str = "cpu"):
    """The model with one op (a ResolvedOps field, or "logprob") back in its fast form; its head."""
    fast_impl = "torch" if device == "cpu" else None
    head = logprob_head("exact")
    if field is None:
        return head
    if field == "logprob":
        return logprob_head(fast_impl)
    ops = model.ops
    fast = linear_ref if field == "logits" else resolve(FAST[field], fast_impl)
    new = dataclasses.replace(ops, **{field: fast})
    for module in model.modules():
        if getattr(module, "ops", None) is ops:
            module.ops = new
    return head


def check(family: str, dtype: str, field: str | None, device: str = "cpu") -> dict:
    torch.manual_seed(0)
    model = vm.build(FAMILIES[family](), dtype=DTYPES[dtype], ops=vm.OpsConfig(exact=True))
    randomize_norms(model)
    model = model.to(device)
    head = switched(model.eval(), field, device)
    reqs = requests()
    completions = generate(model, reqs)
    sequences = [list(r.prompt_ids) + c.token_ids for r, c in zip(reqs, completions)]
    temperatures = [r.params.temperature for r in reqs]
    mismatched, tokens, worst = 0, 0, 0.0
    for micro_batches in packings(len(reqs)):
        trainer = trainer_log_probs(model, head, sequences, temperatures, micro_batches, device)
        for r, c, lp in zip(reqs, completions, trainer):
            rollout = torch.tensor(c.log_probs, dtype=torch.float32)
            ours = lp[len(r.prompt_ids) - 1 :]
            mismatched += int((ours != rollout).sum())
            tokens += rollout.numel()
            worst = max(worst, (ours - rollout).abs().max().item())
    return {"switched": field, "tokens": tokens, "mismatched": mismatched, "max_abs_diff": worst}


if __name__ == "__main__":
    args = sys.argv[1:]
    device = "cpu"
    if args[0] == "--device":
        device, args = args[1], args[2:]
    family, dtype, *fields = args
    for field in [None, *fields]:
        print(json.dumps(check(family, dtype, field, device)), flush=True)
