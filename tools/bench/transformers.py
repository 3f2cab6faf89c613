"""`verl-moe bench transformers`: transformers' `Qwen3_5MoeForCausalLM` training step, patched with
`apply_to_qwen3_5_moe(model)` against unpatched, same weights, one process.

Providers (the reduced Qwen3.5-MoE in bf16, sdpa attention, grouped_mm experts where not patched):
- verl_moe: transformers' model with our kernels swapped in (GDN, conv1d, norms, rope, router, experts, and
  the loss from our fused LM head + log-prob op);
- transformers: unpatched, as users run it: with fla's GDN kernels and gated norm when fla is installed (the
  row's `fla` column says whether it was);
- transformers_torch: unpatched with GatedDeltaNet on transformers' own torch code (no fla, no causal-conv1d).
The step: the model's own loss with labels (as transformers' Trainer runs it: the mean NLL of token t+1;
unpatched, through the full logits), backward. transformers' GatedDeltaNet ignores packing
(attention honours it through position ids, the linear attention does not), so the cases are one sequence.
"""

from __future__ import annotations

import importlib.util

import torch

from .integrations import make_batch, no_accelerator, step_row
from .model import allow_fla_backward_on_hopper

CASES = [
    {"id": "hf-qwen3.5-moe-L8-T8192", "layers": 8, "tokens": 8192},
    # transformers' torch GatedDeltaNet's memory grows past what one GPU holds beside the other two models and
    # their gradients at 16384 tokens (docs/integrations.md)
    {"id": "hf-qwen3.5-moe-L8-T16384", "layers": 8, "tokens": 16384, "providers": ("verl_moe", "transformers")},
]
PROVIDERS = ("verl_moe", "transformers", "transformers_torch")
REFERENCE = "transformers"
MODES = ("fwd", "fwd_bwd")
# the bf16 loss (as `verl-moe bench model`); fp32 equality and gradients: tests/integrations/test_transformers.py
TOLERANCE = {"verl_moe": 1e-3, "transformers": 0.0, "transformers_torch": 1e-3}


def unavailable(provider: str) -> str | None:
    return no_accelerator()


def make_inputs(case: dict, device: torch.device) -> dict:
    allow_fla_backward_on_hopper()
    return {**make_batch(case, device), "models": {}}


def _build(provider: str, inputs: dict):
    from transformers import Qwen3_5MoeForCausalLM
    from verl_moe.integrations.transformers import apply_to_qwen3_5_moe, use_torch_gdn

    config = inputs["config"]
    config._attn_implementation = "sdpa"
    config._experts_implementation = "grouped_mm"  # transformers' fastest expert path
    with torch.device(inputs["input_ids"].device):
        model = Qwen3_5MoeForCausalLM(config).to(inputs["dtype"])
    if provider == "transformers_torch":
        use_torch_gdn(model)
    model.load_state_dict(inputs["state"], strict=True)
    if provider == "verl_moe":
        apply_to_qwen3_5_moe(model)
    return model


def _model(provider: str, inputs: dict):
    if provider not in inputs["models"]:
        inputs["models"][provider] = _build(provider, inputs)
    return inputs["models"][provider]


def run(provider: str, inputs: dict, mode: str) -> list[torch.Tensor]:
    """The model's loss with labels = the input ids (mean NLL of token t+1 at 0..T-2); returns [loss]."""
    model = _model(provider, inputs)
    ids = inputs["input_ids"]
    with torch.set_grad_enabled(mode == "fwd_bwd"):
        loss = model(input_ids=ids, position_ids=inputs["position_ids"], labels=ids).loss
        if mode == "fwd_bwd":
            model.zero_grad(set_to_none=True)
            loss.backward()
    return [loss.detach()]


def derived(case: dict, provider: str, mode: str, inputs: dict, ms: float, peak_extra_gib: float) -> dict:
    row = step_row(case, mode, inputs, _model(provider, inputs), ms, peak_extra_gib)
    row["fla"] = provider == "transformers" and importlib.util.find_spec("fla") is not None
    return row
