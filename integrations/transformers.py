"""Swap transformers' Qwen3.5-MoE / Qwen3-MoE kernels for ours, and back.

`apply_to_qwen3_5_moe(model=None)` replaces, in `transformers.models.qwen3_5_moe.modeling_qwen3_5_moe`:
GatedDeltaNet's chunked gated delta rule and causal conv1d, the (1 + weight) RMSNorm, GatedDeltaNet's gated
RMSNorm, the attention's `apply_rotary_pos_emb` (partial, interleaved mRoPE), the top-k router (fp32
routing) and the routed experts, and gives the causal LM's forward our fused LM head + log-prob op for its
loss when it gets labels (no [tokens, vocab] logits are formed; the output's `logits` is then empty,
[batch, 0, vocab], as a fused-loss forward returns none). `apply_to_qwen3_moe` does the same for Qwen3-MoE's
RMSNorm, rope, router, experts and loss. Vision towers, attention itself, the decode-step kernels of a
generation cache and the LM head's logits (without labels) keep transformers' code (docs/integrations.md).

- `model=None` patches the module: the classes' forwards and the module-level kernels that
  GatedDeltaNet's constructor picks up, so models built afterwards (and the class-level parts of existing
  ones) run ours; fla's gated norm class is set aside so new models build transformers' (ours inside).
- `model=<instance>` patches that model's modules only (instance attributes), leaving the classes alone.
  Where transformers calls a module-level function from a forward (the attention's `apply_rotary_pos_emb`;
  GatedDeltaNet's kernels in newer releases), the instance's module gets a forward that swaps ours in for
  the duration of its own call (one thread at a time).

GatedDeltaNet's kernels are found in one of two places (`gdn_kernels_at_construction`): transformers 5.10
copies the module-level `causal_conv1d_fn` / `chunk_gated_delta_rule` (the causal-conv1d package's and fla's,
or None) into instance attributes of the same names at construction; later releases (5.17) call the
module-level `causal_conv1d_fn` / `torch_chunk_gated_delta_rule` (wrappers that pick fla when installed)
from forward. A class, function or attribute the patch expects and the installed transformers lacks is a
ValueError naming it, never a silently unpatched model.

`revert_*` puts back exactly what `apply_*` replaced, so outputs are again bitwise transformers'. Each
apply resolves our implementations once (`ops.dispatch.resolve`: triton on cuda/npu, the torch reference
on cpu, `VERL_MOE_OPS` overrides).
"""

from __future__ import annotations

import importlib
import inspect
import types
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import adapters

_MISSING = object()


@dataclass(frozen=True)
class Family:
    module: str  # transformers' modeling module
    norm: str  # RMSNorm class
    unit_offset: bool  # (1 + weight) norms
    norm_eps: str  # the RMSNorm's epsilon attribute
    attention: str
    router: str
    experts: str
    norm_topk_prob: bool | None  # None: the router module's own flag
    causal_lm: str  # the causal LM class, whose forward computes the loss
    gdn: str | None = None  # GatedDeltaNet class (Qwen3.5)
    gated_norm: str | None = None


QWEN3_5_MOE = Family(
    module="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    norm="Qwen3_5MoeRMSNorm",
    unit_offset=True,
    norm_eps="eps",
    attention="Qwen3_5MoeAttention",
    router="Qwen3_5MoeTopKRouter",
    experts="Qwen3_5MoeExperts",
    norm_topk_prob=True,  # transformers' Qwen3.5 router always renormalises its top-k
    causal_lm="Qwen3_5MoeForCausalLM",
    gdn="Qwen3_5MoeGatedDeltaNet",
    gated_norm="Qwen3_5MoeRMSNormGated",
)
QWEN3_MOE = Family(
    module="transformers.models.qwen3_moe.modeling_qwen3_moe",
    norm="Qwen3MoeRMSNorm",
    unit_offset=False,
    norm_eps="variance_epsilon",
    attention="Qwen3MoeAttention",
    router="Qwen3MoeTopKRouter",
    experts="Qwen3MoeExperts",
    norm_topk_prob=None,
    causal_lm="Qwen3MoeForCausalLM",
)

# what was replaced, to put back: module -> [(owner, attribute, previous value or _MISSING)]
_class_patches: dict[str, list[tuple[object, str, object]]] = {}
_instance_patches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _norm_forward(family: Family):
    fn = adapters.make_rms_norm(family.unit_offset)

    def forward(module, hidden_states):
        return fn(hidden_states, module.weight, getattr(module, family.norm_eps))

    return forward


def _kernels(family: Family) -> dict:
    """Our callables for `family`, resolved once."""
    kernels = {
        "norm_forward": _norm_forward(family),
        "rope": adapters.make_apply_rotary_pos_emb(),
        "router_forward": adapters.make_route(family.norm_topk_prob),
        "experts_forward": adapters.make_moe_experts_forward(),
    }
    if family.gdn is not None:
        kernels["gated_norm_forward"] = adapters.make_gated_rms_norm_forward()
        kernels["conv"] = adapters.make_causal_conv1d_bct()
        kernels["gdn"] = _gdn_taking_attention_kwargs(adapters.make_chunk_gated_delta_rule())
    return kernels


def fused_loss_forward(original):
    """`original` (a causal LM class's forward) with its loss from our fused LM head + log-prob op when it gets
    labels (or shift_labels): transformers' loss (labels shifted left, -100 ignored, the sum over
    num_items_in_batch when given, else the mean; plus router_aux_loss_coef x the router's aux loss when it
    returns one) without the [tokens, vocab] logits; the output's `logits` is empty. Without labels, with
    `logits_to_keep` or with return_dict=False, `original` as it is."""

    def forward(self, *args, labels=None, logits_to_keep=0, **kwargs):
        shift_labels = kwargs.get("shift_labels")
        keep_all = isinstance(logits_to_keep, int) and logits_to_keep == 0
        if (labels is None and shift_labels is None) or not keep_all or kwargs.get("return_dict") is False:
            return original(self, *args, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
        captured = {}

        def keep_hidden(_module, _inputs, output):  # returns None: the output stays as it is
            captured["hidden"] = output.last_hidden_state

        hook = self.model.register_forward_hook(keep_hidden)
        try:  # no labels: transformers' forward skips its loss; no position kept: an empty lm_head
            out = original(self, *args, labels=None, logits_to_keep=torch.zeros(0, dtype=torch.long), **kwargs)
        finally:
            hook.remove()
        hidden = captured["hidden"]
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
        shift_labels = shift_labels.to(hidden.device)
        log_probs, _ = adapters.masked_logprobs(hidden, self.lm_head.weight, shift_labels, -100, 1.0)
        count = kwargs.get("num_items_in_batch")
        loss = -log_probs.sum() / (count if count is not None else (shift_labels != -100).sum())
        if getattr(out, "aux_loss", None) is not None:
            loss = loss + self.router_aux_loss_coef * out.aux_loss.to(loss.device)
        out["loss"] = loss
        return out

    return forward


def _gdn_taking_attention_kwargs(gdn):
    """transformers 5.17 passes its remaining attention kwargs (max_length_q, ...) on to the GDN kernel."""

    def chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        cu_seqlens=None,
        **_attention_kwargs,
    ):
        return gdn(
            q,
            k,
            v,
            g,
            beta,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=cu_seqlens,
        )

    chunk_gated_delta_rule.verl_moe_impl = gdn.verl_moe_impl
    return chunk_gated_delta_rule


def gdn_kernels_at_construction(mod) -> bool:
    """True where GatedDeltaNet takes its kernels into instance attributes at construction (transformers 5.10),
    False where its forward calls the module-level functions (5.17); see the module docstring."""
    return "chunk_gated_delta_rule" in vars(mod)


def _require(mod, family: Family) -> None:
    names = [family.norm, family.attention, family.router, family.experts, family.causal_lm, "apply_rotary_pos_emb"]
    if family.gdn is not None:
        names += [family.gdn, family.gated_norm, "causal_conv1d_fn"]
        names += [] if gdn_kernels_at_construction(mod) else ["torch_chunk_gated_delta_rule"]
    missing = [name for name in names if not hasattr(mod, name)]
    if missing:
        import transformers

        raise ValueError(f"transformers {transformers.__version__}'s {mod.__name__} has no {', '.join(missing)}")


def _own(owner, attr: str):
    """`owner`'s own value of `attr` (a class's or module's dict; an nn.Module's dict or submodule), or
    _MISSING when it only inherits one."""
    if isinstance(owner, nn.Module):
        return owner.__dict__.get(attr, owner._modules.get(attr, _MISSING))
    return vars(owner).get(attr, _MISSING)


def _set(stash: list, owner, attr: str, value) -> None:
    stash.append((owner, attr, _own(owner, attr)))
    setattr(owner, attr, value)


def _restore(stash: list) -> None:
    for owner, attr, previous in reversed(stash):
        if previous is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, previous)


def _apply_classes(family: Family) -> None:
    if family.module in _class_patches:
        return
    mod = importlib.import_module(family.module)
    _require(mod, family)
    k, stash = _kernels(family), []
    _set(stash, getattr(mod, family.norm), "forward", k["norm_forward"])
    _set(stash, mod, "apply_rotary_pos_emb", k["rope"])
    _set(stash, getattr(mod, family.router), "forward", k["router_forward"])
    _set(stash, getattr(mod, family.experts), "forward", k["experts_forward"])
    causal_lm = getattr(mod, family.causal_lm)
    _set(stash, causal_lm, "forward", fused_loss_forward(causal_lm.forward))
    if family.gdn is not None:
        _set(stash, getattr(mod, family.gated_norm), "forward", k["gated_norm_forward"])
        _set(stash, mod, "causal_conv1d_fn", k["conv"])
        if gdn_kernels_at_construction(mod):
            # read by GatedDeltaNet.__init__; fla's gated norm class (when installed) would bypass ours
            _set(stash, mod, "FusedRMSNormGated", None)
            _set(stash, mod, "chunk_gated_delta_rule", k["gdn"])
        else:
            _set(stash, mod, "torch_chunk_gated_delta_rule", k["gdn"])
    _class_patches[family.module] = stash


def swapping_forward(mod, functions: dict):
    """A forward for one module instance: its class's forward with `mod`'s module-level `functions` (name ->
    callable) swapped in for the duration of the call."""

    def forward(self, *args, **kwargs):
        saved = {name: getattr(mod, name) for name in functions}
        for name, fn in functions.items():
            setattr(mod, name, fn)
        try:
            return type(self).forward(self, *args, **kwargs)
        finally:
            for name, fn in saved.items():
                setattr(mod, name, fn)

    forward.swapped = functions
    return forward


def _apply_instance(family: Family, model: nn.Module) -> None:
    if model in _instance_patches:
        return
    mod = importlib.import_module(family.module)
    _require(mod, family)
    k, stash = _kernels(family), []
    causal_lm = getattr(mod, family.causal_lm)
    bound = {
        getattr(mod, family.norm): k["norm_forward"],
        getattr(mod, family.router): k["router_forward"],
        getattr(mod, family.experts): k["experts_forward"],
        getattr(mod, family.attention): swapping_forward(mod, {"apply_rotary_pos_emb": k["rope"]}),
        causal_lm: fused_loss_forward(causal_lm.forward),
    }
    gdn_cls = getattr(mod, family.gdn) if family.gdn is not None else None
    gated_cls = getattr(mod, family.gated_norm) if family.gated_norm is not None else None
    if gated_cls is not None:
        bound[gated_cls] = k["gated_norm_forward"]
    found = False
    for module in list(model.modules()):
        if gdn_cls is not None and isinstance(module, gdn_cls):
            _set_gdn_kernels(stash, mod, module, gated_cls, k["conv"], k["gdn"], k["gated_norm_forward"])
            found = True
        for cls, forward in bound.items():
            if type(module) is cls:
                _set(stash, module, "forward", types.MethodType(forward, module))
                found = True
    if not found:
        _restore(stash)
        raise ValueError(f"{type(model).__name__} has no {family.module.rpartition('.')[2]} modules to patch")
    _instance_patches[model] = stash


def _set_gdn_kernels(stash: list, mod, module: nn.Module, gated_cls, conv, gdn, norm_forward) -> None:
    """Give one GatedDeltaNet `conv` and `gdn` (and its gated norm `norm_forward`, None: the class's own)."""
    if not gdn_kernels_at_construction(mod):
        kernels = {"causal_conv1d_fn": conv, "torch_chunk_gated_delta_rule": gdn}
        _set(stash, module, "forward", types.MethodType(swapping_forward(mod, kernels), module))
        return
    _set(stash, module, "causal_conv1d_fn", conv)
    _set(stash, module, "chunk_gated_delta_rule", gdn)
    if not isinstance(module.norm, gated_cls):
        # fla's FusedRMSNormGated: transformers' class around the same weight
        norm = gated_cls(module.norm.weight.shape[0], eps=module.norm.eps)
        norm.weight = module.norm.weight
        if norm_forward is not None:
            norm.forward = types.MethodType(norm_forward, norm)
        _set(stash, module, "norm", norm)


def use_torch_gdn(model: nn.Module) -> None:
    """Run `model`'s Qwen3.5-MoE GatedDeltaNet layers on transformers' own torch code (conv, chunked rule,
    gated norm) even where fla is installed: the references of our tests and `verl-moe bench transformers`'
    baseline. For good (no revert); `apply_to_qwen3_5_moe(model)` / `revert_qwen3_5_moe(model)` work on top."""
    mod = importlib.import_module(QWEN3_5_MOE.module)
    _require(mod, QWEN3_5_MOE)
    gdn_cls, gated_cls = getattr(mod, QWEN3_5_MOE.gdn), getattr(mod, QWEN3_5_MOE.gated_norm)
    if gdn_kernels_at_construction(mod):
        conv, gdn = None, mod.torch_chunk_gated_delta_rule  # None: transformers' nn.Conv1d + SiLU path
    else:
        conv, gdn = inspect.unwrap(mod.causal_conv1d_fn), inspect.unwrap(mod.torch_chunk_gated_delta_rule)
    for module in list(model.modules()):
        if isinstance(module, gdn_cls):
            _set_gdn_kernels([], mod, module, gated_cls, conv, gdn, None)


def _apply(family: Family, model: nn.Module | None) -> None:
    if model is None:
        _apply_classes(family)
    else:
        _apply_instance(family, model)


def _revert(family: Family, model: nn.Module | None) -> None:
    if model is None:
        _restore(_class_patches.pop(family.module, []))
    else:
        _restore(_instance_patches.pop(model, []))


def apply_to_qwen3_5_moe(model: nn.Module | None = None) -> None:
    """Our kernels in transformers' Qwen3.5-MoE: in the module (model=None; models built afterwards) or in
    `model`'s modules only. Idempotent. Raises ValueError when `model` has no Qwen3.5-MoE modules."""
    _apply(QWEN3_5_MOE, model)


def revert_qwen3_5_moe(model: nn.Module | None = None) -> None:
    """Undo `apply_to_qwen3_5_moe(model)` (same argument); a no-op when it was not applied."""
    _revert(QWEN3_5_MOE, model)


def apply_to_qwen3_moe(model: nn.Module | None = None) -> None:
    """Our RMSNorm, rope, router and experts in transformers' Qwen3-MoE (see `apply_to_qwen3_5_moe`)."""
    _apply(QWEN3_MOE, model)


def revert_qwen3_moe(model: nn.Module | None = None) -> None:
    """Undo `apply_to_qwen3_moe(model)` (same argument); a no-op when it was not applied."""
    _revert(QWEN3_MOE, model)
