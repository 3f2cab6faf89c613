"""`verl-moe bench rollout`: the decode speed of our rollout engine against transformers' `generate`
on the same model and weights, in one process.

Model: the reduced Qwen3.5-MoE of `verl-moe bench model` (hidden 2048, 64 experts top-8, the real
248,320-token vocabulary, bf16, random weights) with `layers` layers (4: 3 GatedDeltaNet + 1
attention, the size of the one-GPU GRPO run). Batch: `batch` prompts of `prompt_len` random tokens,
`new_tokens` generated each (no end-of-sequence, temperature 1, log-probs on).

Providers, one record each:
- `verl_moe`: `GenerationEngine` with the decode step as device graphs (its default on cuda / npu);
- `verl_moe_eager`: the same engine without graphs;
- `transformers`: `Qwen3_5MoeForCausalLM.generate` (sampling at temperature 1, no top-k; it returns
  no log-probs here: keeping them costs it a [batch, vocab] tensor per step).
Record fields: `cold_step_ms` (a fresh engine's first batch: graph captures and autotuning included),
`first_pass_step_ms` (a batch of new lengths after a warm-up batch of others: what every RL step
meets), `decode_step_ms` (the same lengths again), `prefill_ms`, `tokens_per_s` (generated tokens
over the wall time of that last batch, prefill included), `peak_GiB` (allocated, over the provider's
runs), and `floor_step_ms`: the bytes one decode step must move (every weight but the embedding once,
each GatedDeltaNet state read and written, the KV cache read) over this device's copy bandwidth,
measured here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from ...ops import device as devices

PROVIDERS = ("verl_moe", "verl_moe_eager", "transformers")


def _synced(fn: Callable, *args, **kwargs) -> tuple[float, object]:
    """(wall ms of fn(*args, **kwargs), its result), the device synchronised before and after."""
    devices.synchronize()
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    devices.synchronize()
    return (time.perf_counter() - start) * 1e3, out


def copy_bandwidth(nbytes: int = 2**30) -> float:
    """Bytes per second a device-to-device copy moves (read + write), median of 5."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=devices.current_device())
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = sorted(_synced(dst.copy_, src)[0] for _ in range(5))
    return 2 * nbytes / (times[2] / 1e3)


def step_bytes(model, batch: int, length: int) -> int:
    """Bytes one decode step of `batch` sequences at `length` positions must move at least."""
    weights = sum(p.nbytes for n, p in model.named_parameters() if "embed_tokens" not in n)
    state = kv = 0
    for layer in model.model.layers:
        if layer.layer_type == "linear_attention":
            g = layer.linear_attn
            state += 2 * batch * g.num_v_heads * g.head_k_dim * g.head_v_dim * 4  # fp32, read + write
        else:
            a = layer.self_attn
            kv += 2 * batch * a.num_kv_heads * length * a.head_dim * model.lm_head.weight.element_size()
    return weights + state + kv


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, vocab, (length,), generator=gen).tolist()) for _ in range(batch)]


def _ours(model, graphs: bool, passes: list[tuple[list, int]]) -> list[dict]:
    """One engine through `passes` (prompts, new tokens): per pass its prefill and decode walls."""
    from .engine import GenerationEngine, Request
    from .sampling import SamplingParams

    engine = GenerationEngine(model, [], seed=0, max_num_seqs=max(len(p) for p, _ in passes), device_graphs=graphs)
    out = []
    for n, (prompts, new_tokens) in enumerate(passes):
        params = SamplingParams(max_tokens=new_tokens, temperature=1.0, logprobs=True, ignore_eos=True)
        requests = [Request(f"p{n}-{i}", p, params) for i, p in enumerate(prompts)]
        prefill_ms, _ = _synced(engine.add, requests)
        decode_ms, done = _synced(engine.step, new_tokens - 1)
        if len(done) != len(requests) or any(len(c.token_ids) != new_tokens for c in done):
            raise RuntimeError(f"pass {n}: expected {len(requests)} completions of {new_tokens} tokens")
        out.append({"prefill_ms": prefill_ms, "decode_ms": decode_ms, "steps": new_tokens - 1})
    return out


def _transformers(hf_model, passes: list[tuple[list, int]]) -> list[dict]:
    out = []
    for prompts, new_tokens in passes:
        ids = torch.tensor(prompts, device=hf_model.device)
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=1.0)
        kwargs.update(top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
        ms, generated = _synced(hf_model.generate, ids, attention_mask=torch.ones_like(ids), **kwargs)
        if generated.shape[1] != ids.shape[1] + new_tokens:
            raise RuntimeError(f"transformers generated {generated.shape[1] - ids.shape[1]} tokens, not {new_tokens}")
        out.append({"prefill_ms": float("nan"), "decode_ms": ms, "steps": new_tokens})  # prefill inside
    return out


def run(
    batch: int = 256,
    prompt_len: int = 128,
    new_tokens: int = 256,
    layers: int = 4,
    providers: tuple[str, ...] = PROVIDERS,
    on_record: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Benchmark `providers`; returns one record each (`on_record` sees the records so far after each:
    a provider failing records its error and the others still run).

    Raises:
        ValueError: an unknown provider, or no accelerator (the reduced model needs ~10 GiB).
    """
    from ...models import build
    from ...models.train_step_bench import build_hf, reduced_config

    unknown = sorted(set(providers) - set(PROVIDERS))
    if unknown:
        raise ValueError(f"unknown rollout bench provider(s) {unknown}; choices: {list(PROVIDERS)}")
    if not devices.is_accelerator():
        raise ValueError("verl-moe bench rollout needs a cuda or npu device (the reduced model)")
    dev = devices.current_device()
    torch.manual_seed(0)
    config = reduced_config(layers)
    model = build(config, dtype=torch.bfloat16, device=dev).eval()
    vocab = config.vocab_size
    # warm-up batch of other lengths, then the measured lengths twice (new prompts each time)
    passes = [
        (_prompts(batch, prompt_len + 7, vocab, 1), new_tokens // 2),
        (_prompts(batch, prompt_len, vocab, 2), new_tokens),
        (_prompts(batch, prompt_len, vocab, 3), new_tokens),
    ]
    floor_ms = step_bytes(model, batch, prompt_len + new_tokens) / copy_bandwidth() * 1e3
    records = []
    for provider in providers:
        devices.empty_cache()
        devices.reset_peak_memory_stats()
        try:
            if provider == "transformers":
                hf_model = build_hf(config, model.state_dict(), dev).eval()
                runs = _transformers(hf_model, passes)  # its first call is the cold one
                del hf_model
            else:
                cold = _ours(model, provider == "verl_moe", passes[1:2])  # a fresh engine, first batch
                runs = cold + _ours(model, provider == "verl_moe", passes)[1:]
        except Exception as exc:  # one provider failing leaves the others' records
            records.append({"provider": provider, "batch": batch, "error": f"{type(exc).__name__}: {exc}"})
            if on_record:
                on_record(records)
            continue
        cold, first, repeat = runs
        prefill_ms = 0.0 if math.isnan(repeat["prefill_ms"]) else repeat["prefill_ms"]
        record = {
            "provider": provider,
            "batch": batch,
            "prompt_len": prompt_len,
            "new_tokens": new_tokens,
            "layers": layers,
            "cold_step_ms": cold["decode_ms"] / cold["steps"],
            "first_pass_step_ms": first["decode_ms"] / first["steps"],
            "decode_step_ms": repeat["decode_ms"] / repeat["steps"],
            "prefill_ms": repeat["prefill_ms"],
            "tokens_per_s": batch * new_tokens / ((repeat["decode_ms"] + prefill_ms) / 1e3),
            "peak_GiB": devices.max_memory_allocated() / 2**30,
            "floor_step_ms": floor_ms,
        }
        records.append(record)
        if on_record:
            on_record(records)
    return records


__all__ = ["PROVIDERS", "copy_bandwidth", "run", "step_bytes"]
