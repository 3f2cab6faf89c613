"""`verl-moe bench veomni`: VeOmni's own reduced Qwen3.5-MoE training step with its default GPU kernels
against the same model with `verl_moe` in every slot we serve, same weights, one process.

Providers (both VeOmni 0.1.12's `build_foundation_model`, sdpa attention, its Triton load-balancing loss):
- verl_moe: `<op>_implementation=verl_moe` for every field of `integrations.veomni.CONFIG_FIELDS` (GDN,
  conv1d, RMSNorm, gated RMSNorm, MoE experts, the fused cross-entropy head);
- veomni: VeOmni's GPU defaults as `verl-moe bench model` runs them (fla GDN / conv / gated norm, Liger
  RMSNorm and fused cross-entropy, its Triton group-GEMM MoE).
The step: forward with labels (VeOmni's shifted loss), backward. Cases: one 8192-token sequence and 16,384
tokens packed as 16 sequences (`cu_seq_lens_q/k`, which VeOmni's decoder requires).

VeOmni's slots are module globals shared by every model of one modeling module, so each provider's bound
kernels (slots, transformers' LOSS_MAPPING, VeOmni's fused-MoE pointer) are saved after its build and put
back before each of its steps.
"""

from __future__ import annotations

import importlib.util
import sys

import torch

from .integrations import make_batch, no_accelerator, step_row
from .model import VEOMNI_GPU_OPS, allow_fla_backward_on_hopper

CASES = [
    {"id": "veomni-qwen3.5-moe-L8-T8192", "layers": 8, "tokens": 8192},
    {"id": "veomni-qwen3.5-moe-L8-T16384-N16", "layers": 8, "tokens": 16384, "sequences": 16},
]
PROVIDERS = ("verl_moe", "veomni")
REFERENCE = "veomni"
MODES = ("fwd", "fwd_bwd")
# the check compares the bf16 loss (as `verl-moe bench model`); gradients are tested in fp32 on CPU
# (tests/integrations/test_veomni_kernels.py)
TOLERANCE = {"verl_moe": 1e-3, "veomni": 0.0}


def unavailable(provider: str) -> str | None:
    reason = no_accelerator()
    if reason:
        return reason
    if importlib.util.find_spec("veomni") is None:
        return "VeOmni is not installed (pip install veomni==0.1.12 --no-deps)"
    if provider == "veomni":
        missing = [p for p in ("fla", "liger_kernel") if importlib.util.find_spec(p) is None]
        if missing:
            return f"VeOmni's GPU kernels need {', '.join(missing)} ('verl-moe[bench]')"
    else:
        from verl_moe.integrations import veomni as integration

        try:
            integration.register()  # `import verl` runs it through our plugin; this process may not import verl
        except RuntimeError as exc:
            return str(exc)
    return None


def _ops(provider: str):
    from veomni.arguments import OpsImplementationConfig
    from verl_moe.integrations import veomni as integration
    from verl_moe.ops import device

    if provider == "verl_moe":
        fields = dict.fromkeys(integration.CONFIG_FIELDS, integration.IMPL_NAME)
        return OpsImplementationConfig(
            attn_implementation="sdpa",
            # VeOmni's own kernel in both providers; its eager one where there is no GPU (the CPU test)
            load_balancing_loss_implementation="triton" if device.is_accelerator() else "eager",
            swiglu_mlp_implementation="eager",
            **fields,
        )
    return OpsImplementationConfig(**VEOMNI_GPU_OPS)


def _bindings(module) -> dict:
    """What binding a model set in process-wide places: its module's slots, LOSS_MAPPING, the MoE pointer."""
    from transformers.loss.loss_utils import LOSS_MAPPING
    from veomni.ops.kernels import moe

    slots = {v: (v._kernel, v._impl_name) for v in vars(module).values() if type(v).__name__ == "OpSlot"}
    return {"slots": slots, "loss": dict(LOSS_MAPPING), "moe": moe._fused_moe_forward}


def _rebind(bindings: dict) -> None:
    from transformers.loss.loss_utils import LOSS_MAPPING
    from veomni.ops.kernels import moe

    for slot, (kernel, name) in bindings["slots"].items():
        slot._kernel, slot._impl_name = kernel, name
    LOSS_MAPPING.update(bindings["loss"])
    moe._fused_moe_forward = bindings["moe"]


def make_inputs(case: dict, device: torch.device) -> dict:
    """The batch and weights; each provider's model is built on its first `run` (in the untimed warm-up)."""
    allow_fla_backward_on_hopper()
    return {**make_batch(case, device), "models": {}}


def _model(provider: str, inputs: dict):
    if provider not in inputs["models"]:
        from veomni.models import build_foundation_model

        device = inputs["input_ids"].device
        model = build_foundation_model(
            inputs["config"],
            torch_dtype=str(inputs["dtype"]).removeprefix("torch."),
            init_device=device.type,
            ops_implementation=_ops(provider),
        )
        missing, unexpected = model.load_state_dict(inputs["state"], strict=False)
        if missing or unexpected:
            raise ValueError(
                f"VeOmni's model does not take the weights: missing {missing[:4]}, unexpected {unexpected[:4]}"
            )
        inputs["models"][provider] = (model, _bindings(sys.modules[type(model).__module__]))
    return inputs["models"][provider]


def run(provider: str, inputs: dict, mode: str) -> list[torch.Tensor]:
    """Forward with labels (VeOmni's loss: mean NLL of token t+1), and backward for "fwd_bwd"; returns [loss]."""
    model, bindings = _model(provider, inputs)
    _rebind(bindings)
    ids, cu, T = inputs["input_ids"], inputs["cu_seqlens"], inputs["max_seqlen"]
    with torch.set_grad_enabled(mode == "fwd_bwd"):
        out = model(
            input_ids=ids,
            labels=ids,
            position_ids=inputs["position_ids"],
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=T,
            max_length_k=T,
            use_cache=False,  # its generated GDN code reads conv states off a cache newer transformers lack
        )
        if mode == "fwd_bwd":
            model.zero_grad(set_to_none=True)
            out.loss.backward()
    return [out.loss.detach()]


def derived(case: dict, provider: str, mode: str, inputs: dict, ms: float, peak_extra_gib: float) -> dict:
    return step_row(case, mode, inputs, _model(provider, inputs)[0], ms, peak_extra_gib)
