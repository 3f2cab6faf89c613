"""`verl-moe bench model`: one training step (forward, log-prob loss, backward) of a reduced
Qwen3.5-MoE, ours against transformers (with fla when installed) from the same weights.

The reduced model is ENVIRONMENT.md's anchor: hidden 2048, 8 layers (6 GatedDeltaNet + 2
attention), 64 experts top-8, the real 248,320-token vocabulary, bf16, one 8192-token sequence.
"""

from __future__ import annotations

import importlib.util

import torch

CASES = [
    {"id": "qwen3.5-moe-reduced-L8-T8192", "layers": 8, "tokens": 8192},
    # transformers' sdpa and fla paths ignore packing: time it, but its loss is not comparable.
    {"id": "qwen3.5-moe-reduced-L8-T4x2048-packed", "layers": 8, "tokens": 8192, "sequences": 4, "check": False},
]
PROVIDERS = ("ours", "hf")
REFERENCE = "hf"
MODES = ("fwd", "fwd_bwd")
# The check compares the loss only. In bf16 the lm_head gradient of each implementation is ~3% (rel
# RMS) off an fp32 golden of the same weights (measured on CPU at hidden 256, 64 experts, VOCAB 8192:
# ours 2.8%, transformers 3.4%), so two bf16 gradients cannot check each other; gradient
# correctness is tested in fp32 against transformers in tests/models. The bf16 losses agreed to 7e-5.
TOLERANCE = {"ours": 1e-3, "hf": 0.0}


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
    from ..ops import device

    if not device.is_accelerator():
        return "the reduced model needs an accelerator (about 30 GiB)"
    return None


def make_inputs(case: dict, device: torch.device) -> dict:
    from transformers import Qwen3_5MoeForCausalLM

    from . import build

    if importlib.util.find_spec("fla") is not None:
        # fla 0.6 refuses its GDN backward on Hopper with Triton 3.4-3.7.0 (its own guard against a
        # Triton miscompile); its gradients matched the reference at K=128 (ENVIRONMENT.md).
        import fla.ops.common.chunk_o as fla_chunk_o

        fla_chunk_o.TRITON_ABOVE_3_7_1 = True

    torch.manual_seed(0)
    config = reduced_config(case["layers"])
    ours = build(config, dtype=torch.bfloat16, device=device)
    config._attn_implementation = "sdpa"
    config._experts_implementation = "grouped_mm"  # transformers' fastest expert path (as in ENVIRONMENT.md)
    hf = Qwen3_5MoeForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    hf.load_state_dict(ours.state_dict(), strict=True)
    T, N = case["tokens"], case.get("sequences", 1)
    input_ids = torch.randint(0, config.vocab_size, (1, T), device=device)
    bounds = torch.linspace(0, T, N + 1).long().tolist()
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
    position_ids = torch.cat([torch.arange(e - s, device=device) for s, e in zip(bounds[:-1], bounds[1:])])[None]
    return {
        "ours": ours,
        "hf": hf,
        "input_ids": input_ids,
        "position_ids": position_ids,
        "cu_seqlens": cu_seqlens if N > 1 else None,
    }


def run(provider: str, inputs: dict, mode: str) -> list[torch.Tensor]:
    """Loss = mean next-token negative log-likelihood, forward (and backward for "fwd_bwd"); returns [loss]."""
    from ..ops import logprobs_and_entropy

    model = inputs[provider]
    ids, pos, cu = inputs["input_ids"], inputs["position_ids"], inputs["cu_seqlens"]
    labels = torch.roll(ids, -1, dims=1)[0]
    with torch.set_grad_enabled(mode == "fwd_bwd"):
        if provider == "ours":
            hidden = model(ids, pos, cu_seqlens=cu).last_hidden_state[0]
            logp, _ = logprobs_and_entropy(hidden, model.lm_head.weight, labels, calculate_entropy=False)
        else:
            # transformers: packed sequences via position ids restarting at 0 (its flash/sdpa path).
            logits = model(input_ids=ids, position_ids=pos).logits[0].float()
            logp = torch.log_softmax(logits, -1).gather(-1, labels[:, None])[:, 0]
        loss = -logp.mean()
        if mode == "fwd_bwd":
            model.zero_grad(set_to_none=True)
            loss.backward()
    return [loss.detach()]
