"""One vLLM-CPU weight-sync check in its own process (vLLM starts engine and worker processes; keeping them out
of pytest's process keeps its state out of other tests). Used by test_vllm_cpu.py:

    VERL_PLATFORM=cpu python tests/engines/vllm_cpu_check.py FAMILY OUT_JSON [--bad-update]

FAMILY: qwen3_moe (fp32 in vLLM) or qwen3_5_moe (bf16: vLLM-CPU runs GatedDeltaNet in bf16/fp16 only). A tiny
model with peaked weights (see `peaked_model`) is saved, served by vLLM's offline engine with verl_moe's CPU
worker extension, and greedy-decoded; then its weights change (a stand-in for a training step) and reach vLLM
through verl's own weight-sync path: `BucketedWeightSender` over shared memory, in small buckets, into the
extension's `update_weights_from_ipc`. The JSON holds, before and after the sync, vLLM's sampled tokens and
log-probs and our model's log-probs of the same tokens (fp32). `--bad-update` sends a tensor of a wrong shape
instead and records what the sync raised and how long it took.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
import threading
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = [[5, 17, 33, 99, 7], [42, 3], [200, 201, 202, 17, 8, 9, 77]]
NEW_TOKENS = 8


def config(family: str):
    """The tiny model of `scripts/toy_rl.py` that vLLM-CPU serves (its docstring lists vLLM-CPU's limits)."""
    spec = importlib.util.spec_from_file_location("toy_rl", os.path.join(ROOT, "scripts", "toy_rl.py"))
    toy_rl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(toy_rl)
    if family not in ("qwen3_moe", "qwen3_5_moe"):
        raise ValueError(f"family {family!r}: expected qwen3_moe or qwen3_5_moe")
    return toy_rl.tiny_vllm_config(family)


def peaked_model(family: str, seed: int = 0):
    """Random weights with the lm_head and the experts scaled up. Why: at the default init a tiny model's
    next-token distribution is near uniform, and a rollout holding wrong weights (stale experts) then gives
    nearly the same log-probs; peaked logits, with the experts weighing on them, make any wrong weight show."""
    import verl_moe.models as vm

    torch.manual_seed(seed)
    model = vm.build(config(family))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0 if model.arch.norm_unit_offset else 1.0, 0.2)
            elif name.startswith("lm_head"):
                p.mul_(40)
            elif ".experts." in name:
                p.mul_(20)
    return model


def train_step_stand_in(model, seed: int = 1) -> None:
    """Move every weight by half its own spread: what a rollout must pick up after an update."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std().clamp_min(1e-3) * 0.5)


def our_log_probs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    ids = torch.tensor(prompt + tokens)
    with torch.no_grad():
        hidden = model(ids[None], torch.arange(len(ids))[None]).last_hidden_state
        log_probs = torch.log_softmax(model.logits(hidden).double(), -1)[0]
    return log_probs[len(prompt) - 1 : -1].gather(-1, ids[len(prompt) :, None])[:, 0].tolist()


def generate(llm, model) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0, detokenize=False, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    rows = []
    for prompt, out in zip(PROMPTS, outputs):
        sample = out.outputs[0]
        tokens = list(sample.token_ids)
        vllm_lp = [step[token].logprob for step, token in zip(sample.logprobs, tokens)]
        rows.append({"tokens": tokens, "vllm": vllm_lp, "ours": our_log_probs(model, prompt, tokens)})
    return rows


def sync_weights(llm, named_tensors) -> dict:
    """verl's path: the trainer side sends buckets over ZMQ + shared memory while vLLM's workers receive them
    in `update_weights_from_ipc` (the handle name as verl's worker extension computes it)."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    handle = f"ipc:///tmp/rl-colocate-zmq-{os.environ['VERL_RAY_JOB_ID']}-replica-0-rank-0.sock"
    sender = BucketedWeightSender(zmq_handle=handle, bucket_size_mb=1, use_shm=True)
    sent = {}
    thread = threading.Thread(target=lambda: sent.update(ok=asyncio.run(sender.async_send_weights(named_tensors))))
    start = time.monotonic()
    thread.start()
    error = None
    try:
        llm.collective_rpc("update_weights_from_ipc", kwargs={"use_shm": True})
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        error = f"{type(exc).__name__}: {exc}"
    thread.join(timeout=60)
    return {"error": error, "seconds": time.monotonic() - start, "sender_finished": not thread.is_alive()}


def main(family: str, out: str, bad_update: bool) -> None:
    """The KV cache gets an explicit 256 MiB: without one vLLM-CPU reserves a share of host memory minus its own
    resident memory, which machine to machine can come out too small or negative."""
    import verl  # noqa: F401 - the plugin: vLLM name alias, CPU platform
    import verl_moe.models as vm
    from verl_moe.engines.export import per_tensor_params
    from vllm import LLM

    model = peaked_model(family)
    path = os.path.join(os.path.dirname(os.path.abspath(out)), f"{family}_model")
    vm.save_pretrained(model, path)
    llm = LLM(
        model=path, skip_tokenizer_init=True, dtype="float32" if family == "qwen3_moe" else "bfloat16",
        enforce_eager=True, max_model_len=64, max_num_seqs=4, seed=0, kv_cache_memory_bytes=256 << 20,
        worker_extension_cls="verl_moe.engines.vllm_cpu.worker.CpuVllmWorkerExtension",
    )  # fmt: skip
    result = {"before": generate(llm, model)}
    if bad_update:
        name, tensor = next(iter(per_tensor_params(model)))
        result["sync"] = sync_weights(llm, [(name, torch.zeros(tensor.shape[0] + 1, *tensor.shape[1:]))])
    else:
        train_step_stand_in(model)
        result["sync"] = sync_weights(llm, per_tensor_params(model))
        result["after"] = generate(llm, model)
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    # one id for this check's ZMQ socket name, inherited by vLLM's spawned processes
    os.environ.setdefault("VERL_RAY_JOB_ID", f"vllm-cpu-check-{os.getpid()}")
    main(sys.argv[1], sys.argv[2], "--bad-update" in sys.argv[3:])
