"""`verl-moe bench exact`: exact mode against fast mode on the reduced Qwen3.5-MoE, in one process, on one
set of weights.

Requests shaped like an RL step (`rl_requests`): `requests` prompts of uniform random lengths in
[32, 512] tokens, each generating a uniform random number of tokens in [16, 256] (`ignore_eos`, temperature
1, log-probs on), from fixed seeds. For each mode (the model's ops resolved fast, then exact):

- the rollout: a fresh `GenerationEngine` generates them all (`cold_generate_s`: captures, autotuning), then
  a second engine generates them again (`prefill_s`, `decode_s`, and `decode_step_ms` = decode_s over the
  longest request's decode steps);
- the trainer: the prompt + response sequences packed into micro-batches of at most `micro_batch_tokens`
  tokens, forward and log-prob head (the fast head, or exact mode's), and each response token's log-prob
  compared with the one the rollout returned: `max_abs_logprob_diff`, `mean_abs_logprob_diff`,
  `mismatched_tokens` (exact mode: 0 and 0.0 is the claim);
- the training step: forward, the head's mean log-prob as the loss, backward, over the first micro-batch
  (`train_step_ms`, median of 3 after one warm-up).

Records carry `mode`, `requests`, `tokens` (response tokens compared) and the fields above; the exact record
also `decode_ratio` and `train_ratio` (exact over fast).

Then, on the first `ablation_requests` requests, where fast mode's mismatch comes from (`mode` "ablation",
one fresh engine and the trainer's packing per record): the model all fast and all exact, then per op group
(`OP_GROUPS`) the fast model with only that group exact (`direction` "exact_only") and the exact model with
only that group fast ("fast_only"); each with `mean_abs_logprob_diff`, `max_abs_logprob_diff`,
`mismatched_tokens`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ...ops import device as devices
from .rollout import _synced, generate_fresh, rl_requests

MODES = ("fast", "exact")
# the ResolvedOps fields of each op as the ablation switches it (the rollout's and the trainer's paths of an op
# together); "logprob" is the trainer's log-prob head
OP_GROUPS = {
    "linear": ("linear",),
    "logits": ("logits",),
    "norm": ("norm",),
    "rope": ("rope",),
    "attention": ("attention", "attention_decode", "attention_cached"),
    "gdn": ("gdn", "gdn_step", "gdn_positions"),
    "conv1d": ("conv1d", "conv1d_step", "conv1d_positions"),
    "router": ("router",),
    "experts": ("experts",),
    "sampling": ("sampling",),
    "logprob": (),
}


def use_ops(model, ops) -> None:
    """Point every module of `model` that holds the model's resolved ops at `ops` instead."""
    current = model.ops
    for module in model.modules():
        if getattr(module, "ops", None) is current:
            module.ops = ops


def _seconds(fn: Callable, *args, **kwargs):
    """(wall seconds of fn(*args, **kwargs), its result), the device synchronised around it."""
    ms, out = _synced(fn, *args, **kwargs)
    return ms / 1e3, out


def _generate(model, requests):
    """A fresh engine generates `requests`: (prefill s, decode s, completions in request order)."""
    run = generate_fresh(model, requests)
    return run["prefill_ms"] / 1e3, run["decode_ms"] / 1e3, run["done"]


def _micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    groups, used = [[]], 0
    for n, length in enumerate(lengths):
        if groups[-1] and used + length > budget:
            groups.append([])
            used = 0
        groups[-1].append(n)
        used += length
    return groups


def _packed(sequences, group, dev):
    seqs = [sequences[n] for n in group]
    ids = torch.tensor([t for s in seqs for t in s], device=dev)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs]).to(dev)[None]
    cu_cpu = [0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()]
    labels = torch.cat([torch.tensor(s[1:] + [0]) for s in seqs]).to(dev)
    return ids, pos, torch.tensor(cu_cpu, dtype=torch.int32, device=dev), cu_cpu, labels


def _trainer_log_probs(model, head, sequences, groups, dev) -> list[torch.Tensor]:
    out = {}
    for group in groups:
        ids, pos, cu, cu_cpu, labels = _packed(sequences, group, dev)
        inv_t = torch.ones(labels.shape[0], device=dev)
        with torch.no_grad():
            hidden = model(ids, pos, cu, cu_seqlens_cpu=cu_cpu).last_hidden_state[0]
            log_probs, _ = head(hidden, model.lm_head.weight, labels, inv_t, calculate_entropy=False)
        for n, a, b in zip(group, cu_cpu[:-1], cu_cpu[1:]):
            out[n] = log_probs[a : b - 1].float().cpu()
    return [out[n] for n in range(len(sequences))]


def _mismatch(model, head, reqs, completions, micro_batch_tokens: int, dev) -> tuple[dict, list, list]:
    """The trainer's log-probs of the rollout's sequences (`completions` of `reqs`), packed into micro-batches
    of at most `micro_batch_tokens`, against the rollout's: (the diff fields, sequences, micro-batches)."""
    sequences = [list(r.prompt_ids) + c.token_ids for r, c in zip(reqs, completions)]
    groups = _micro_batches([len(s) for s in sequences], micro_batch_tokens)
    trainer = _trainer_log_probs(model, head, sequences, groups, dev)
    diffs = torch.cat(
        [
            (lp[len(r.prompt_ids) - 1 :] - torch.tensor(c.log_probs, dtype=torch.float32)).abs()
            for r, c, lp in zip(reqs, completions, trainer)
        ]
    )
    fields = {
        "requests": len(reqs),
        "tokens": diffs.numel(),
        "max_abs_logprob_diff": diffs.max().item(),
        "mean_abs_logprob_diff": diffs.mean().item(),
        "mismatched_tokens": int((diffs != 0).sum()),
    }
    return fields, sequences, groups


def _ablation(model, fast_ops, exact_ops, reqs, micro_batch_tokens: int, dev) -> list[dict]:
    """Fast mode's mismatch taken apart by op group (see the module docstring)."""
    from ...ops.logprob import logprob_head

    heads = {"fast": logprob_head(), "exact": logprob_head("exact")}
    runs = [("all", "fast", fast_ops, "fast"), ("all", "exact", exact_ops, "exact")]
    for op, fields in OP_GROUPS.items():
        exact_only = dataclasses.replace(fast_ops, **{f: getattr(exact_ops, f) for f in fields})
        fast_only = dataclasses.replace(exact_ops, **{f: getattr(fast_ops, f) for f in fields})
        runs.append((op, "exact_only", exact_only, "exact" if op == "logprob" else "fast"))
        runs.append((op, "fast_only", fast_only, "fast" if op == "logprob" else "exact"))
    records = []
    for op, direction, ops, head in runs:
        use_ops(model, ops)
        completions = generate_fresh(model, reqs, graphs=dev.type == "cuda")["done"]
        fields, _, _ = _mismatch(model, heads[head], reqs, completions, micro_batch_tokens, dev)
        records.append({"mode": "ablation", "op": op, "direction": direction, **fields})
    use_ops(model, fast_ops)
    return records


def _train_step_s(model, head, sequences, group, dev) -> float:
    ids, pos, cu, cu_cpu, labels = _packed(sequences, group, dev)
    inv_t = torch.ones(labels.shape[0], device=dev)

    def step():
        hidden = model(ids, pos, cu, cu_seqlens_cpu=cu_cpu).last_hidden_state[0]
        log_probs, _ = head(hidden, model.lm_head.weight, labels, inv_t, calculate_entropy=False)
        (-log_probs.mean()).backward()
        model.zero_grad(set_to_none=True)

    step()
    return sorted(_seconds(step)[0] for _ in range(3))[1]


def reduced_setup(requests: int, layers: int) -> tuple:
    """The bench's reduced model on this device from fixed seeds, its fast and exact ops and `requests` RL-shaped
    requests: (model, fast ops, exact ops, requests). The model holds its fast ops (`use_ops` switches)."""
    from ...models import OpsConfig, build
    from ...models.causal_lm import resolve_ops
    from .model import reduced_config

    torch.manual_seed(0)
    config = reduced_config(layers)
    model = build(config, dtype=torch.bfloat16, device=devices.current_device())
    exact_ops = resolve_ops(OpsConfig(exact=True), model.arch, torch.bfloat16)
    return model, model.ops, exact_ops, rl_requests(requests, config.vocab_size)


def run(
    requests: int = 256,
    layers: int = 4,
    micro_batch_tokens: int = 16384,
    ablation_requests: int = 64,
    on_record: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Both modes on the reduced model; one record per mode (see the module docstring).

    Raises:
        ValueError: no accelerator (the reduced model needs ~20 GiB).
    """
    from ...ops.logprob import logprob_head

    if not devices.is_accelerator():
        raise ValueError("verl-moe bench exact needs a cuda device (the reduced model)")
    dev = devices.current_device()
    model, fast_ops, exact_ops, reqs = reduced_setup(requests, layers)
    records = []
    for mode in MODES:
        ops, head = (exact_ops, logprob_head("exact")) if mode == "exact" else (fast_ops, logprob_head())
        use_ops(model, ops)
        devices.empty_cache()
        devices.reset_peak_memory_stats()
        cold_s, _ = _seconds(_generate, model, reqs)
        prefill_s, decode_s, completions = _generate(model, reqs)
        fields, sequences, groups = _mismatch(model, head, reqs, completions, micro_batch_tokens, dev)
        steps = max(r.params.max_tokens for r in reqs) - 1
        record = {
            "mode": mode,
            "layers": layers,
            **fields,
            "cold_generate_s": cold_s,
            "prefill_s": prefill_s,
            "decode_s": decode_s,
            "decode_step_ms": decode_s / steps * 1e3,
            "train_step_ms": _train_step_s(model, head, sequences, groups[0], dev) * 1e3,
            "train_tokens": sum(len(sequences[n]) for n in groups[0]),
            "peak_GiB": devices.max_memory_allocated() / 2**30,
        }
        if mode == "exact" and records:
            fast = records[0]
            record["decode_ratio"] = record["decode_step_ms"] / fast["decode_step_ms"]
            record["train_ratio"] = record["train_step_ms"] / fast["train_step_ms"]
        records.append(record)
        if on_record:
            on_record(records)
    use_ops(model, fast_ops)
    if ablation_requests:
        for record in _ablation(model, fast_ops, exact_ops, reqs[:ablation_requests], micro_batch_tokens, dev):
            records.append({**record, "layers": layers})
            if on_record:
                on_record(records)
    return records


__all__ = ["MODES", "OP_GROUPS", "reduced_setup", "run", "use_ops"]
