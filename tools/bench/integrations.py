"""What the two integration benchmarks share (`veomni.py`, `transformers.py`): the reduced
Qwen3.5-MoE of `verl-moe bench model` (`model.py`), its weights, the packed batch and the
per-row throughput columns."""

from __future__ import annotations

import torch

from .model import PEAK_TFLOPS, reduced_config


def no_accelerator() -> str | None:
    from verl_moe.ops import device

    if not device.is_accelerator():
        return "the reduced model needs an accelerator (about 30 GiB)"
    return None


def make_batch(case: dict, device: torch.device, config=None, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The case's config (the reduced model unless `config` is given: the CPU test's tiny one), transformers-
    initialised weights in `dtype` on `device`, and one packed batch."""
    from transformers import Qwen3_5MoeForCausalLM

    torch.manual_seed(0)
    config = config if config is not None else reduced_config(case["layers"])
    with torch.device(device):
        init = Qwen3_5MoeForCausalLM(config).to(dtype)
    T, N = case["tokens"], case.get("sequences", 1)
    bounds = torch.linspace(0, T, N + 1).long().tolist()
    seqlens = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    return {
        "config": config,
        "dtype": dtype,
        "state": init.state_dict(),
        "seqlens": seqlens,
        "input_ids": torch.randint(0, config.vocab_size, (1, T), device=device),
        "position_ids": torch.cat([torch.arange(n, device=device) for n in seqlens])[None],
        "cu_seqlens": torch.tensor(bounds, dtype=torch.int32, device=device),
        "max_seqlen": max(seqlens),
    }


def step_row(case: dict, mode: str, inputs: dict, model, ms: float, peak_extra_gib: float) -> dict:
    """tokens/s, MFU (models/flops.py's model FLOPs over `PEAK_TFLOPS`, a measured bf16 matmul rate) and the
    provider's own peak memory (its weights + the step's extra peak)."""
    from verl_moe.models.flops import TRAIN_FACTOR, forward_flops
    from verl_moe.models.registry import get_spec

    config = inputs["config"]
    spec = get_spec(config.model_type)
    arch = spec.arch_config(spec.text_config(config))
    flops = forward_flops(arch, inputs["seqlens"]) * (TRAIN_FACTOR if mode == "fwd_bwd" else 1)
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 1024**3
    return {
        "tokens_per_s": case["tokens"] / (ms / 1e3),
        "mfu": flops / (ms / 1e3) / (PEAK_TFLOPS * 1e12),
        "peak_gib": weights + peak_extra_gib,
    }
