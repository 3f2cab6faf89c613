"""Our kernels as VeOmni kernel-registry entries, under the implementation name `verl_moe`.

VeOmni's generated modeling files declare module-level `OpSlot(op, variant)`s; at model build,
`build_foundation_model` binds each from `OpsImplementationConfig` (`<op>_implementation`, and
`moe_implementation` for the experts) through `veomni.ops.kernel_registry.KERNEL_REGISTRY`. `register()`
adds one `KernelSpec` named `verl_moe` per slot in `SLOTS` and replaces none of VeOmni's. With it, verl's
own VeOmni engine selects ours by config: `engine.chunk_gated_delta_rule_implementation=verl_moe` (etc.).

Two of VeOmni's selections do not go through the registry alone, and both document the hook a third-party
backend uses; `register()` wraps each so that `verl_moe` is handled and every other name reaches VeOmni
unchanged:
- `moe_implementation` also binds a module-level pointer (`ops.kernels.moe.apply_veomni_fused_moe_patch`,
  which raises on a name it does not know);
- `cross_entropy_loss_implementation` also fills transformers' `LOSS_MAPPING`
  (`ops.kernels.cross_entropy.install_loss_mapping`, the same).
On Ascend, VeOmni's config check allows listed names per field only (`_NPU_ALLOWED`): `verl_moe` is added to
the fields we serve.

Checks, each failing with one line naming what differs: the installed VeOmni must be a version these
entries were read against (`CHECKED_VERSIONS`); every slot in `SLOTS` must exist in its registry; and at
bind time every call VeOmni's loaded modeling code makes to the slot must fit our callable's signature
(`check_call_sites`), so a changed call site is an error at model build, not a wrong argument later.
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

from verl_moe.ops.common import runtime

from . import adapters

logger = logging.getLogger(__name__)

IMPL_NAME = "verl_moe"
CHECKED_VERSIONS = ("0.1.12",)
# Our Triton kernels' bf16 tl.dot needs sm80+; under TRITON_INTERPRET they also run on CPU (the tests).
MIN_COMPUTE_CAPABILITY = 80
GENERATED_PREFIX = "veomni.models.transformers."


def _experts_kernel() -> Callable:
    forward = adapters.make_moe_experts_forward()

    def moe_experts_forward(module, hidden_states, top_k_index, top_k_weights):
        from veomni.distributed.parallel_state import get_parallel_state

        if get_parallel_state().ep_enabled:
            # VeOmni's fused kernels do its expert-parallel all-to-all; ours take global expert ids over local weights
            raise ValueError("moe_implementation=verl_moe does not run VeOmni's expert parallelism (ep_size > 1)")
        return forward(module, hidden_states, top_k_index, top_k_weights)

    moe_experts_forward.verl_moe_impl = forward.verl_moe_impl
    return moe_experts_forward


def _fused_moe_forward_raw() -> Callable:
    """VeOmni's raw `fused_moe_forward` signature (what `veomni.ops.fused_moe_forward` dispatches to)."""
    import torch

    impl = adapters.make_moe_experts_forward().verl_moe_impl

    def fused_moe_forward(
        num_experts,
        routing_weights,
        selected_experts,
        hidden_states,
        fc1_1_weight,
        fc1_2_weight,
        fc2_weight,
        fc1_1_2_weight=None,
        swiglu_limit=None,
    ):
        if swiglu_limit is not None:
            raise ValueError("moe_implementation=verl_moe has no clamped SwiGLU (swiglu_limit)")
        gate_up = fc1_1_2_weight if fc1_1_2_weight is not None else torch.cat([fc1_1_weight, fc1_2_weight], dim=1)
        return impl(hidden_states, gate_up, fc2_weight, selected_experts, routing_weights)

    fused_moe_forward.verl_moe_impl = impl
    return fused_moe_forward


def _cross_entropy_fn() -> Callable:
    """VeOmni's inner cross-entropy contract: (logits, labels [N], vocab_size, num_items_in_batch, ignore_index,
    hidden_states=[N, D], weights=[VOCAB, D]) -> (loss, logits); the LM head is fused (logits stay None)."""
    import torch

    def verl_moe_cross_entropy(
        logits=None, labels=None, vocab_size=None, num_items_in_batch=None, ignore_index=-100, **kwargs
    ):
        hidden, weight = kwargs.get("hidden_states"), kwargs.get("weights")
        if hidden is None or weight is None:
            raise ValueError("verl_moe cross-entropy fuses the LM head: it needs hidden_states= and weights=")
        logp, _ = adapters.masked_logprobs(hidden, weight, labels, ignore_index, 1.0)
        # transformers' fixed_cross_entropy: a sum over num_items_in_batch when given, else the mean over kept tokens
        total = -logp.sum()
        if num_items_in_batch is not None:
            count = num_items_in_batch.to(total.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
        else:
            count = (labels != ignore_index).sum().clamp_min(1)
        return total / count, logits

    return verl_moe_cross_entropy


def _causal_lm_loss() -> Callable:
    """VeOmni's causal-LM loss wrapper contract, `(loss, logits, fused_linear_aux)`: the plain loss through
    our fused head (VeOmni's `ForCausalLMLoss` keeps its label shift and sequence-parallel reduction), and
    `return_log_probs=True` (verl's VeOmni engine with use_fused_kernels) through our log-prob + entropy
    kernel with VeOmni's shift rules; top-k distillation stays VeOmni's."""
    import torch
    from veomni.distributed.parallel_state import get_parallel_state
    from veomni.ops.kernels.cross_entropy import ForCausalLMLoss
    from veomni.utils.model_outputs import FusedLinearAuxOutput

    loss_fn = partial(ForCausalLMLoss, cross_entropy_fn=_cross_entropy_fn())

    def verl_moe_causal_lm_loss(*args, **kwargs):
        if not kwargs.get("return_log_probs") or kwargs.get("teacher_topk_ids") is not None:
            return loss_fn(*args, **kwargs)
        hidden, weight, labels = kwargs["hidden_states"], kwargs["weights"], kwargs["labels"]
        shift_labels, ignore_index = kwargs.get("shift_labels"), kwargs.get("ignore_index", -100)
        # as VeOmni's chunk_logprobs: explicit shift_labels as given; under SP the collator shifted them;
        # else shift here and pad the last position (no next token) with 0
        shift_here = shift_labels is None and not get_parallel_state().sp_enabled
        if shift_labels is None:
            shift_labels = labels[..., 1:] if shift_here else labels
        temperature = kwargs.get("temperature", 1.0)
        if shift_here:
            hidden = hidden[..., :-1, :]
            if torch.is_tensor(temperature) and temperature.numel() > 1:
                temperature = temperature[..., :-1]
        logp, entropy = adapters.masked_logprobs(hidden, weight, shift_labels, ignore_index, temperature)
        if shift_here:
            logp, entropy = (torch.nn.functional.pad(t, (0, 1)) for t in (logp, entropy))
        return None, None, FusedLinearAuxOutput(log_probs=logp, entropy=entropy)

    verl_moe_causal_lm_loss.verl_moe_impl = adapters.logprobs_and_entropy
    return verl_moe_causal_lm_loss


def _seq_cls_loss() -> Callable:
    from veomni.ops.kernels.cross_entropy import ForSequenceClassificationLoss

    fn = partial(ForSequenceClassificationLoss, cross_entropy_fn=_cross_entropy_fn())
    return fn


# (op, variant) -> (factory of our callable, description). The config field is `<op>_implementation`,
# `moe_implementation` for moe_experts.
SLOTS: dict[tuple[str, str], tuple[Callable[[], Callable], str]] = {
    ("chunk_gated_delta_rule", "standard"): (adapters.make_chunk_gated_delta_rule, "gated delta rule, chunked"),
    ("causal_conv1d", "standard"): (adapters.make_causal_conv1d_btc, "depthwise causal conv1d + SiLU, varlen"),
    ("rms_norm", "standard"): (partial(adapters.make_rms_norm, False), "RMSNorm x * weight"),
    ("rms_norm", "qwen3_5"): (partial(adapters.make_rms_norm, True), "RMSNorm x * (1 + weight), Qwen3.5"),
    ("rms_norm_gated", "standard"): (lambda: adapters.GatedRMSNorm, "RMSNorm * silu(gate), GatedDeltaNet's"),
    ("rotary_pos_emb", "full"): (adapters.make_apply_rotary_pos_emb, "RoPE, rotate-half"),
    ("rotary_pos_emb", "partial"): (adapters.make_apply_rotary_pos_emb, "RoPE on the first rotary_dim features"),
    ("moe_experts", "standard"): (_experts_kernel, "routed SwiGLU experts, grouped GEMM"),
    ("cross_entropy_loss", "causal"): (_causal_lm_loss, "fused LM head: loss, log-probs + entropy"),
    ("cross_entropy_loss", "seq_cls"): (_seq_cls_loss, "fused LM head: token-level classification loss"),
}
# VeOmni's OpsImplementationConfig fields that can name `verl_moe`
CONFIG_FIELDS = (
    "chunk_gated_delta_rule_implementation",
    "causal_conv1d_implementation",
    "rms_norm_implementation",
    "rms_norm_gated_implementation",
    "rotary_pos_emb_implementation",
    "moe_implementation",
    "cross_entropy_loss_implementation",
)


def _slot_kernel_factory(op: str, variant: str) -> Callable[[], Callable]:
    make = SLOTS[(op, variant)][0]

    def factory():
        kernel = make()
        check_call_sites(op, variant, kernel)
        return kernel

    factory.verl_moe_slot = (op, variant)
    return factory


def _hardware():
    from veomni.ops.kernel_registry import HardwareRequirement

    devices = ["gpu", "npu"] + (["any"] if runtime.interpreting() else [])
    return HardwareRequirement(device_type=devices, min_compute_capability=MIN_COMPUTE_CAPABILITY)


def register() -> bool:
    """Add our `KernelSpec`s and the two name hooks to the installed VeOmni; idempotent. Returns False when
    VeOmni is not installed. Raises RuntimeError (one line) for a VeOmni version or slot we were not checked
    against, or a `verl_moe` entry that is not ours."""
    import importlib.util

    if importlib.util.find_spec("veomni") is None:
        return False
    import veomni
    from veomni.ops.kernel_registry import KERNEL_REGISTRY, KernelSpec

    if veomni.__version__ not in CHECKED_VERSIONS:
        raise RuntimeError(
            f"VeOmni {veomni.__version__} is not a version verl_moe's kernel entries were checked against "
            f"({', '.join(CHECKED_VERSIONS)})"
        )
    buckets = KERNEL_REGISTRY._specs  # no public listing of (op, variant) pairs
    missing = [f"{op}/{variant}" for op, variant in SLOTS if (op, variant) not in buckets]
    if missing:
        raise RuntimeError(f"VeOmni {veomni.__version__} has no kernel slot {', '.join(missing)}")
    hardware = _hardware()
    for op, variant in SLOTS:
        current = buckets[(op, variant)].get(IMPL_NAME)
        if current is not None:
            if getattr(current.factory, "verl_moe_slot", None) != (op, variant):
                raise RuntimeError(f"VeOmni's kernel registry already holds another '{IMPL_NAME}' for {op}/{variant}")
            continue
        spec = KernelSpec(
            name=IMPL_NAME,
            op_name=op,
            variant=variant,
            factory=_slot_kernel_factory(op, variant),
            hardware=hardware,
            description=f"verl_moe: {SLOTS[(op, variant)][1]}",
        )
        KERNEL_REGISTRY.register(spec)
    _wrap_name_hooks()
    _allow_on_npu()
    logger.info("verl_moe: %d kernels registered in VeOmni %s as '%s'", len(SLOTS), veomni.__version__, IMPL_NAME)
    return True


def _wrap_name_hooks() -> None:
    from veomni.ops.kernels import cross_entropy, moe

    if not getattr(moe.apply_veomni_fused_moe_patch, "verl_moe_hook", False):
        moe.apply_veomni_fused_moe_patch = _moe_patch_hook(moe.apply_veomni_fused_moe_patch)
    if not getattr(cross_entropy.install_loss_mapping, "verl_moe_hook", False):
        cross_entropy.install_loss_mapping = _loss_mapping_hook(cross_entropy.install_loss_mapping)


def _moe_patch_hook(veomni_patch: Callable) -> Callable:
    @functools.wraps(veomni_patch)
    def apply_veomni_fused_moe_patch(fused_moe_kernel: str = "triton") -> None:
        if fused_moe_kernel != IMPL_NAME:
            return veomni_patch(fused_moe_kernel)
        from veomni.lora.ops import bind_lora_moe_kernels
        from veomni.ops.kernels import moe

        moe._fused_moe_forward = _fused_moe_forward_raw()
        bind_lora_moe_kernels(fused_moe_kernel)  # no LoRA-aware kernel of ours: VeOmni clears its pointers

    apply_veomni_fused_moe_patch.verl_moe_hook = True
    return apply_veomni_fused_moe_patch


def _loss_mapping_hook(veomni_install: Callable) -> Callable:
    @functools.wraps(veomni_install)
    def install_loss_mapping(impl: str = "eager") -> str:
        if impl != IMPL_NAME:
            return veomni_install(impl)
        from transformers.loss.loss_utils import LOSS_MAPPING

        causal = _causal_lm_loss()
        LOSS_MAPPING["ForCausalLM"] = causal
        LOSS_MAPPING["ForConditionalGeneration"] = causal
        LOSS_MAPPING["ForSequenceClassification"] = _seq_cls_loss()
        return f"CrossEntropy ({IMPL_NAME})"

    install_loss_mapping.verl_moe_hook = True
    return install_loss_mapping


def _allow_on_npu() -> None:
    from veomni.arguments import arguments_types

    for name in CONFIG_FIELDS:
        allowed = arguments_types._NPU_ALLOWED.get(name)
        if allowed is not None and IMPL_NAME not in allowed:
            arguments_types._NPU_ALLOWED[name] = allowed | {IMPL_NAME}


# ---------------------------------------------------------------------------------------------- call sites


@functools.cache
def _parsed(path: str, mtime: float) -> ast.Module:
    return ast.parse(Path(path).read_text(), filename=path)


def slot_calls(tree: ast.Module, op: str, variant: str) -> list[ast.Call]:
    """Calls in a modeling module to its `OpSlot(op, variant)`: direct (`slot(...)`) and through the
    instance attribute a constructor stores from `slot.bound_kernel()` (`self.attr(...)`)."""
    slots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            if isinstance(func, ast.Name) and func.id == "OpSlot":
                args = [a.value for a in node.value.args if isinstance(a, ast.Constant)]
                if args == [op, variant] and isinstance(node.targets[0], ast.Name):
                    slots.add(node.targets[0].id)
    attrs = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute):
            for call in ast.walk(node.value):
                if (
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "bound_kernel"
                    and isinstance(call.func.value, ast.Name)
                    and call.func.value.id in slots
                ):
                    attrs.add(node.targets[0].attr)
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in slots:
            calls.append(node)
        elif isinstance(func, ast.Attribute) and func.attr in attrs and isinstance(func.value, ast.Name):
            if func.value.id == "self":
                calls.append(node)
    return calls


def call_fits(kernel: Callable, call: ast.Call) -> str | None:
    """Why `call` (positional count, keyword names; `*args` / `**kwargs` splats are not checked) cannot
    bind to `kernel`'s signature, or None when it can."""
    positional = sum(1 for a in call.args if not isinstance(a, ast.Starred))
    keywords = [k.arg for k in call.keywords if k.arg is not None]
    try:
        inspect.signature(kernel).bind(*([None] * positional), **dict.fromkeys(keywords))
    except TypeError as exc:
        return str(exc)
    return None


def check_call_sites(op: str, variant: str, kernel: Callable) -> None:
    """Raise ValueError (one line) when a loaded VeOmni modeling module calls the slot in a way `kernel` does
    not take. Runs when VeOmni binds the slot, after it imported the modeling module it binds."""
    for name, module in list(sys.modules.items()):
        if not name.startswith(GENERATED_PREFIX) or ".generated." not in name:
            continue
        path = getattr(module, "__file__", None)
        if not path:
            continue
        tree = _parsed(path, Path(path).stat().st_mtime)
        for call in slot_calls(tree, op, variant):
            why = call_fits(kernel, call)
            if why is not None:
                raise ValueError(
                    f"VeOmni slot {op}/{variant} is called as `{ast.unparse(call.func)}(...)` at {name}:{call.lineno} "
                    f"with arguments verl_moe's kernel does not take ({why})"
                )
