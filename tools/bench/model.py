"""`verl-moe bench model`: one training step (forward, next-token log-prob loss, backward) of a reduced
Qwen3.5-MoE, ours against VeOmni's own model and transformers (with fla when installed), all built from
the same weights in one process.

The reduced model has Qwen3.5-35B-A3B's layer shapes with fewer layers and experts: hidden 2048, 8 layers
(6 GatedDeltaNet + 2 attention), 64 experts top-8, the real 248,320-token vocabulary, bf16. Cases: one
8192-token sequence, and 16,384 tokens packed as 1, 16 or 64 sequences (RL micro-batches are many short
sequences); long single sequences (32K, 128K, 256K tokens) with activation checkpointing per decoder layer,
ours only (`-ckpt`); these keep their gradients between steps (zeroed in place), so their peak above the
inputs is activation memory.

`--offload` (the `offload` option) adds activation offload to ours (`models/activation_offload.py`: each
decoder layer's saved tensors, its checkpoint units' inputs under checkpointing, go to pinned host memory
and come back ahead of backward); rows then also carry the peak host memory the offload held (`host_gib`).
With offload the `-ckpt` cases checkpoint inside each layer in 16,384-token tiles, as the engines do
(`fsdp_plan.checkpoint_in_tiles`); `--checkpoint-units layer|tiles` (the `checkpoint_units` option)
picks the units either way, for the ablation, and `--tile-tokens N` (`tile_tokens`) the tile.

Providers:
- ours: `verl_moe.models.build` with the default ops, log-prob through our fused head;
- veomni: VeOmni 0.1.12's `build_foundation_model` with its GPU kernels (fla GDN / conv / gated norm,
  Liger RMSNorm and fused cross-entropy, its Triton group-GEMM MoE, sdpa), as verl's VeOmni engine runs
  it; packed sequences through `cu_seq_lens_q/k`;
- hf: transformers' `Qwen3_5MoeForCausalLM` (sdpa, grouped_mm experts, fla when installed); it ignores
  packing, so its loss is compared on one-sequence cases only.
Each row also carries tokens/s, MFU (the step's model FLOPs, `models/flops.py` as verl's `perf/mfu/actor`
counts them for our models, over the time and a measured dense bf16 matmul rate, `PEAK_TFLOPS`) and the
provider's own peak memory (its weights + inputs + the step's extra peak).
"""

from __future__ import annotations

import importlib.util

import torch

CASES = [
    {"id": "qwen3.5-moe-reduced-L8-T8192", "layers": 8, "tokens": 8192},
    {"id": "qwen3.5-moe-reduced-L8-T16384", "layers": 8, "tokens": 16384},
    # transformers ignores packing: timed, its loss not compared.
    {"id": "qwen3.5-moe-reduced-L8-T16384-N16", "layers": 8, "tokens": 16384, "sequences": 16, "unchecked": ("hf",)},
    {"id": "qwen3.5-moe-reduced-L8-T16384-N64", "layers": 8, "tokens": 16384, "sequences": 64, "unchecked": ("hf",)},
    # per-layer activation checkpointing, for the long-sequence memory limits; the other providers
    # have no checkpointing here
    *(
        {
            "id": f"qwen3.5-moe-reduced-L8-T{t}-ckpt",
            "layers": 8,
            "tokens": t,
            "checkpoint": True,
            "providers": ("ours",),
        }
        for t in (32768, 131072, 262144)
    ),
]
OPTIONS = ("offload", "checkpoint_units", "tile_tokens")  # what `BenchConfig.extra` may set on every case
PROVIDERS = ("ours", "veomni", "hf")
REFERENCE = "veomni"
MODES = ("fwd", "fwd_bwd")
# The check compares the loss only. In bf16 the lm_head gradient of each implementation is ~3% (rel
# RMS) off an fp32 golden of the same weights (measured on CPU at hidden 256, 64 experts, VOCAB 8192:
# ours 2.8%, transformers 3.4%), so two bf16 gradients cannot check each other; gradient
# correctness is tested in fp32 against transformers in tests/models. The bf16 losses agreed to 7e-5.
TOLERANCE = {"ours": 1e-3, "veomni": 0.0, "hf": 1e-3}
# The MFU denominator: the dense bf16 matmul rate the benchmark GPU reaches, below the datasheet peak in
# verl's table (docs/benchmarking.md, MFU; BENCHMARKS.md).
PEAK_TFLOPS = 790.0


def reduced_config(layers: int):
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        vocab_size=248320,
        hidden_size=2048,
        num_hidden_layers=layers,
        full_attention_interval=4,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        tie_word_embeddings=False,
    )


def unavailable(provider: str) -> str | None:
    from ...ops import device

    if not device.is_accelerator():
        return "the reduced model needs an accelerator (about 30 GiB)"
    if provider == "veomni":
        missing = [p for p in ("veomni", "fla", "liger_kernel") if importlib.util.find_spec(p) is None]
        if missing:
            return f"VeOmni's GPU model needs {', '.join(missing)} (pip install veomni --no-deps; 'verl-moe[bench]')"
        if device.device_type() != "cuda":
            return "VeOmni's fla / Liger kernels run on cuda only"
    return None


def allow_fla_backward_on_hopper() -> None:
    # fla 0.6 refuses its GDN backward on Hopper with Triton 3.4-3.7.0 (its own guard against a Triton
    # miscompile); its gradients match the fp32 reference at K=128 (the bench's check).
    if importlib.util.find_spec("fla") is not None:
        import fla.ops.common.chunk_o as fla_chunk_o

        fla_chunk_o.TRITON_ABOVE_3_7_1 = True


def build_hf(config, state: dict, device):
    """transformers' Qwen3_5MoeForCausalLM of `config` holding `state` (our names are its names), bf16."""
    from transformers import Qwen3_5MoeForCausalLM

    config._attn_implementation = "sdpa"
    config._experts_implementation = "grouped_mm"  # transformers' fastest expert path (eager loops over experts)
    model = Qwen3_5MoeForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    model.load_state_dict(state, strict=True)
    return model


# VeOmni's GPU kernels for its Qwen3.5-MoE (`OpsImplementationConfig` fields): the anchor of the model
# step and of the VeOmni integration bench.
VEOMNI_GPU_OPS = {
    "attn_implementation": "sdpa",
    "moe_implementation": "fused_triton",
    "cross_entropy_loss_implementation": "liger_kernel",
    "rms_norm_implementation": "liger_kernel",
    "rms_norm_gated_implementation": "fla",
    "causal_conv1d_implementation": "fla",
    "chunk_gated_delta_rule_implementation": "fla",
    "load_balancing_loss_implementation": "triton",
}


def _build_veomni(config, state: dict, device):
    from veomni.arguments import OpsImplementationConfig
    from veomni.models import build_foundation_model

    ops = OpsImplementationConfig(**VEOMNI_GPU_OPS)
    model = build_foundation_model(config, torch_dtype="bfloat16", init_device=device.type, ops_implementation=ops)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"VeOmni's model does not take our state dict: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    return model


def make_inputs(case: dict, device: torch.device) -> dict:
    """The step's batch and our model; VeOmni's and transformers' models are built from our weights on
    their first `run` (inside the untimed warm-up), so an unselected provider costs nothing."""
    from ...models import build
    from ...models.fsdp_plan import OFFLOAD_TILE_TOKENS, checkpoint_decoder_layer, decoder_layers, offload_activations

    allow_fla_backward_on_hopper()
    torch.manual_seed(0)
    config = reduced_config(case["layers"])
    ours = build(config, dtype=torch.bfloat16, device=device)
    offload = offload_activations(ours) if case.get("offload") else None
    if case.get("checkpoint"):
        units = case.get("checkpoint_units") or ("tiles" if offload is not None else "layer")
        if units not in ("layer", "tiles"):
            raise ValueError(f"checkpoint_units={units!r}: use 'layer' or 'tiles'")
        tile_tokens = (case.get("tile_tokens") or OFFLOAD_TILE_TOKENS) if units == "tiles" else 0
        for layer in decoder_layers(ours):
            checkpoint_decoder_layer(layer, tile_tokens)
    T, N = case["tokens"], case.get("sequences", 1)
    input_ids = torch.randint(0, config.vocab_size, (1, T), device=device)
    bounds = torch.linspace(0, T, N + 1).long().tolist()
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
    position_ids = torch.cat([torch.arange(e - s, device=device) for s, e in zip(bounds[:-1], bounds[1:])])[None]
    return {
        "config": config,
        "seqlens": [e - s for s, e in zip(bounds[:-1], bounds[1:])],
        "ours": ours,
        "input_ids": input_ids,
        "position_ids": position_ids,
        "cu_seqlens": cu_seqlens,
        "max_seqlen": max(e - s for s, e in zip(bounds[:-1], bounds[1:])),
        "packed": N > 1,
        "offload": offload,
        "keep_grads": bool(case.get("checkpoint")),
    }


def _model(provider: str, inputs: dict):
    if provider not in inputs:
        build_other = {"hf": build_hf, "veomni": _build_veomni}[provider]
        state = inputs["ours"].state_dict()
        inputs[provider] = build_other(inputs["config"], state, inputs["input_ids"].device)
    return inputs[provider]


def run(provider: str, inputs: dict, mode: str) -> list[torch.Tensor]:
    """Loss = mean negative log-likelihood of token t+1 at positions 0..T-2 (the last position has no
    label in VeOmni's shifted loss), forward (and backward for "fwd_bwd"); returns [loss]."""
    from ...ops import logprobs_and_entropy

    model = _model(provider, inputs)
    ids, pos, cu = inputs["input_ids"], inputs["position_ids"], inputs["cu_seqlens"]
    labels = ids[0, 1:]
    with torch.set_grad_enabled(mode == "fwd_bwd"):
        if provider == "ours":
            hidden = model(ids, pos, cu_seqlens=cu if inputs["packed"] else None).last_hidden_state[0, :-1]
            logp, _ = logprobs_and_entropy(hidden, model.lm_head.weight, labels, calculate_entropy=False)
            loss = -logp.mean()
        elif provider == "veomni":
            # VeOmni's decoder asserts cu_seq_lens_q; its fused cross-entropy shifts the labels itself.
            T = inputs["max_seqlen"]
            out = model(
                input_ids=ids,
                labels=ids,
                position_ids=pos,
                cu_seq_lens_q=cu,
                cu_seq_lens_k=cu,
                max_length_q=T,
                max_length_k=T,
                use_cache=False,  # its generated GDN code reads conv states off a cache transformers 5.17 lacks
            )
            loss = out.loss
        else:
            # transformers: packed sequences via position ids restarting at 0 (its flash/sdpa path).
            logits = model(input_ids=ids, position_ids=pos).logits[0, :-1].float()
            loss = -torch.log_softmax(logits, -1).gather(-1, labels[:, None]).mean()
        if mode == "fwd_bwd":
            # The -ckpt cases keep their gradients (zeroed in place) as an engine's step does, so their
            # peak above the weights and gradients is the step's activation memory; the others free them.
            model.zero_grad(set_to_none=not inputs["keep_grads"])
            loss.backward()
    return [loss.detach()]


def derived(case: dict, provider: str, mode: str, inputs: dict, ms: float, peak_extra_gib: float) -> dict:
    """Per-row throughput and memory: tokens/s, MFU (model FLOPs of the forward, three times that with
    backward; the recompute of checkpointing not counted), the provider's own peak (its weights + the
    step's extra peak; the batch is a few KiB), and for ours with offload the peak host memory it held."""
    from ...models.flops import TRAIN_FACTOR, forward_flops

    tokens = case["tokens"]
    model = _model(provider, inputs)
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 1024**3
    flops = forward_flops(inputs["ours"].arch, inputs["seqlens"]) * (TRAIN_FACTOR if mode == "fwd_bwd" else 1)
    row = {
        "flops": flops,  # the step's model FLOPs (models/flops.py), the MFU numerator
        "tokens_per_s": tokens / (ms / 1e3),
        "mfu": flops / (ms / 1e3) / (PEAK_TFLOPS * 1e12),
        "peak_gib": weights + peak_extra_gib,
    }
    if provider == "ours" and inputs["offload"] is not None:
        row["host_gib"] = inputs["offload"].peak_host_bytes / 1024**3
    return row
