"""LoRA on the spec: low-rank adapters added to frozen base weights, as peft's LoRA computes them.

An adapted weight W [out, in] gains factors A [r, in] (Kaiming-uniform, as peft) and B [out, r]
(zeros: the model starts as the base model) and computes with W + scale * B @ A, scale = alpha / r:

- `LoraLinear` replaces an `nn.Linear` (attention q/k/v/o_proj, GatedDeltaNet in_proj_qkv / in_proj_z /
  in_proj_b / in_proj_a / out_proj, shared-expert projections): x @ W^T + scale * (x @ A^T) @ B^T, the
  factored product (no [out, in] delta);
- `LoraExperts` replaces the fused routed `Experts`: per-expert factors A [E, r, in], B [E, out, r] for
  gate_up_proj [E, 2I, D] and / or down_proj [E, D, I]; each forward hands the grouped experts op the
  weights W + scale * B @ A of the experts this rank holds (one bmm per adapted weight). The factors are
  parameters of the experts module itself, so expert parallelism splits them over experts exactly as it
  splits the expert weights (`fsdp_plan.shard_experts` takes every parameter of the module).

Names stay the base model's (`...q_proj.weight`, `...mlp.experts.gate_up_proj`); the adapters add
`...q_proj.lora_A` / `lora_B` and `...mlp.experts.gate_up_proj_lora_A` / `_lora_B` (`peft_name` maps
them to peft's `base_model.model.<module>.lora_A.weight`). `apply_lora` freezes every other parameter.
Alphabet: E experts, D hidden, I expert width, r rank.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from .fsdp_plan import decoder_layers
from .layers import Experts

ALL_LINEAR = "all-linear"
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
_ADAPTER_SUFFIXES = (".lora_A", ".lora_B", "_lora_A", "_lora_B")


@dataclass(frozen=True)
class LoraSettings:
    """What to adapt and how (verl's model_config.lora_rank / lora_alpha / target_modules /
    target_parameters / exclude_modules).

    target_modules: "all-linear" (every nn.Linear of the decoder layers: attention, GatedDeltaNet,
        shared expert; not the routed experts, as peft) or names, each matched as the last dotted
        parts of a module name ("q_proj", "self_attn.o_proj") or of a routed-expert weight
        ("gate_up_proj", "mlp.experts.down_proj"). target_parameters: more routed-expert weight names.
    exclude_modules: a regex (full match on the name, peft's str form) or names (matched as targets).
    Raises ValueError for rank < 1.
    """

    rank: int
    alpha: float
    target_modules: str | tuple[str, ...] = ALL_LINEAR
    target_parameters: tuple[str, ...] = ()
    exclude_modules: str | tuple[str, ...] | None = None

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"lora_rank={self.rank}: a LoRA rank must be >= 1")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _kaiming_uniform_(t: torch.Tensor, generator: torch.Generator | None) -> None:
    """peft's A init (kaiming_uniform_ with a=sqrt(5): U(-1/sqrt(in), 1/sqrt(in))) per [r, in] matrix,
    so a stack [E, r, in] draws each expert's factor as a [r, in] one would."""
    if t.is_meta:
        return
    bound = 1.0 / math.sqrt(t.shape[-1])
    with torch.no_grad():
        t.uniform_(-bound, bound, generator=generator)


class LoraLinear(nn.Linear):
    """An nn.Linear (weight [out, in], bias) plus A [r, in], B [out, r]:
    y = x W^T + b + scale * (x A^T) B^T. Holds the base module's own parameters (same names)."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, generator: torch.Generator | None = None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        factory = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **factory))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **factory))
        _kaiming_uniform_(self.lora_A, generator)
        self.scale = scale
        self.adapter_enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.adapter_enabled:
            return out
        return out + self.scale * F.linear(F.linear(x, self.lora_A), self.lora_B)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_rank={self.lora_A.shape[0]}, scale={self.scale}"


class LoraExperts(Experts):
    """Fused routed experts plus per-expert factors `<w>_lora_A` [E, r, in], `<w>_lora_B` [E, out, r]
    for each adapted weight w in `targets` (gate_up_proj [E, 2I, D], down_proj [E, D, I])."""

    def __init__(
        self, base: Experts, targets: tuple[str, ...], rank: int, scale: float, generator: torch.Generator | None = None
    ):
        nn.Module.__init__(self)
        self.gate_up_proj, self.down_proj = base.gate_up_proj, base.down_proj
        self.ops, self.expert_parallel = base.ops, base.expert_parallel
        self.targets, self.scale, self.adapter_enabled = tuple(targets), scale, True
        for name in self.targets:
            weight = getattr(self, name)
            E, out_features, in_features = weight.shape
            factory = dict(device=weight.device, dtype=weight.dtype)
            a = nn.Parameter(torch.empty(E, rank, in_features, **factory))
            _kaiming_uniform_(a, generator)
            self.register_parameter(f"{name}_lora_A", a)
            self.register_parameter(f"{name}_lora_B", nn.Parameter(torch.zeros(E, out_features, rank, **factory)))

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up, down = super().expert_weights()
        if not self.adapter_enabled:
            return gate_up, down
        merged = {"gate_up_proj": gate_up, "down_proj": down}
        for name in self.targets:
            a, b = (_local(getattr(self, f"{name}_lora_{f}")) for f in "AB")
            merged[name] = merged[name] + self.scale * torch.bmm(b, a)
        return merged["gate_up_proj"], merged["down_proj"]

    def extra_repr(self) -> str:
        return f"targets={self.targets}, scale={self.scale}"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def lora_candidates(model: nn.Module) -> tuple[list[str], list[str]]:
    """(nn.Linear module names, routed-expert weight names) of the decoder layers of `model` (a
    MoeCausalLM or MoeVisionLM), in module order: what LoRA may adapt."""
    names = {id(m): n for n, m in model.named_modules()}
    linears, experts = [], []
    for layer in decoder_layers(model):
        for sub in layer.modules():
            if isinstance(sub, nn.Linear):
                linears.append(names[id(sub)])
            elif isinstance(sub, Experts):
                experts.extend(f"{names[id(sub)]}.{w}" for w in EXPERT_WEIGHTS)
    return linears, experts


def _matches(name: str, pattern: str) -> bool:
    return name == pattern or name.endswith("." + pattern)


def resolve_targets(model: nn.Module, settings: LoraSettings) -> tuple[list[str], list[str]]:
    """(nn.Linear names, routed-expert weight names) `settings` adapts in `model`.
    Raises ValueError naming a target entry that matches nothing, or when exclusion leaves nothing."""
    linears, experts = lora_candidates(model)
    if settings.target_modules == ALL_LINEAR:
        picked_linear, picked_experts = list(linears), []
        entries = list(settings.target_parameters)
    else:
        picked_linear, picked_experts = [], []
        entries = list(settings.target_modules) + list(settings.target_parameters)
    leaves = sorted({n.rsplit(".", 1)[-1] for n in linears + experts})
    for entry in entries:
        hit_linear = [n for n in linears if _matches(n, entry)]
        hit_experts = [n for n in experts if _matches(n, entry)]
        if not hit_linear and not hit_experts:
            raise ValueError(
                f"LoRA target {entry!r} matches no module of the decoder layers (LoRA-able names: {', '.join(leaves)})"
            )
        picked_linear += [n for n in hit_linear if n not in picked_linear]
        picked_experts += [n for n in hit_experts if n not in picked_experts]
    exclude = settings.exclude_modules

    def excluded(name: str) -> bool:
        if exclude is None:
            return False
        if isinstance(exclude, str):
            return re.fullmatch(exclude, name) is not None
        return any(_matches(name, e) for e in exclude)

    picked_linear = [n for n in picked_linear if not excluded(n)]
    picked_experts = [n for n in picked_experts if not excluded(n)]
    if not picked_linear and not picked_experts:
        raise ValueError(f"LoRA: exclude_modules={exclude!r} leaves no target module")
    # keep module order (candidates' order), whatever the entries' order
    order = {n: i for i, n in enumerate(linears + experts)}
    return sorted(picked_linear, key=order.__getitem__), sorted(picked_experts, key=order.__getitem__)


def apply_lora(model: nn.Module, settings: LoraSettings, generator: torch.Generator | None = None) -> list[str]:
    """Adapt `model` in place (before sharding): each target nn.Linear becomes a `LoraLinear`, each
    experts module with a target weight a `LoraExperts`; every non-adapter parameter gets
    requires_grad False. A factors drawn from `generator` in module order (nothing drawn on the meta
    device). Returns the adapted names (modules, and expert weights as `<experts>.<weight>`)."""
    linear_names, expert_names = resolve_targets(model, settings)
    model.requires_grad_(False)
    for name in linear_names:
        parent, leaf = _parent(model, name)
        setattr(parent, leaf, LoraLinear(getattr(parent, leaf), settings.rank, settings.scale, generator))
    per_module: dict[str, list[str]] = {}
    for name in expert_names:
        module, weight = name.rsplit(".", 1)
        per_module.setdefault(module, []).append(weight)
    for module_name, weights in per_module.items():
        parent, leaf = _parent(model, module_name)
        targets = tuple(w for w in EXPERT_WEIGHTS if w in weights)
        setattr(parent, leaf, LoraExperts(getattr(parent, leaf), targets, settings.rank, settings.scale, generator))
    return linear_names + expert_names


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def lora_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every LoraLinear / LoraExperts in `model`."""
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear | LoraExperts):
            yield name, module


def adapted_weights(model: nn.Module) -> dict[str, tuple[str, str, float]]:
    """{base weight state-dict name: (A name, B name, scale)} of `model`'s adapters, in module order
    (names relative to `model`)."""
    out = {}
    for name, module in lora_modules(model):
        if isinstance(module, LoraLinear):
            out[f"{name}.weight"] = (f"{name}.lora_A", f"{name}.lora_B", module.scale)
        else:
            for w in module.targets:
                out[f"{name}.{w}"] = (f"{name}.{w}_lora_A", f"{name}.{w}_lora_B", module.scale)
    return out


def is_adapter_key(name: str) -> bool:
    return name.endswith(_ADAPTER_SUFFIXES)


def peft_name(name: str) -> str:
    """peft's name of an adapter state-dict entry: `x.q_proj.lora_A` -> `base_model.model.x.q_proj.lora_A.weight`,
    `x.experts.gate_up_proj_lora_B` -> `base_model.model.x.experts.gate_up_proj.lora_B.weight`."""
    if not is_adapter_key(name):
        raise ValueError(f"{name!r} is not a LoRA adapter entry")
    return f"base_model.model.{name[:-7]}.{name[-6:]}.weight"


def merge_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """weight + scale * B @ A in weight's dtype (the product in fp32 at least): [out, in] with A [r, in],
    B [out, r], or [E, out, in] with A [E, r, in], B [E, out, r]."""
    dtype = torch.promote_types(weight.dtype, torch.float32)
    delta = torch.matmul(lora_b.to(dtype), lora_a.to(dtype))
    return (weight.to(dtype) + scale * delta).to(weight.dtype)


def merged_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (full tensors under `model`'s names) with every adapted weight merged and the adapter
    entries dropped: the base model's names and shapes. Without adapters, `state` itself."""
    adapted = adapted_weights(model)
    if not adapted:
        return state
    out = {k: v for k, v in state.items() if not is_adapter_key(k)}
    for name, (a, b, scale) in adapted.items():
        out[name] = merge_weight(state[name], state[a], state[b], scale)
    return out


@contextmanager
def adapters_disabled(model: nn.Module):
    """The base model for the duration (verl's `disable_adapter`: reference log-probs of a LoRA actor)."""
    modules = [m for _, m in lora_modules(model)]
    for m in modules:
        m.adapter_enabled = False
    try:
        yield
    finally:
        for m in modules:
            m.adapter_enabled = True


def peft_config_dict(settings: LoraSettings, model: nn.Module) -> dict:
    """The peft LoraConfig (as `to_dict()`) verl's FSDP engine passes with unmerged adapters, for the
    adapters of `model`: the adapted nn.Linear leaf names as target_modules, the routed-expert weights
    (`mlp.experts.gate_up_proj`, ...) as target_parameters."""
    from peft import LoraConfig, TaskType

    linear, expert = set(), set()
    for name, module in lora_modules(model):
        if isinstance(module, LoraLinear):
            linear.add(name.rsplit(".", 1)[-1])
        else:
            expert.update(".".join([*name.split(".")[-2:], w]) for w in module.targets)
    config = LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=settings.rank,
        lora_alpha=settings.alpha,
        target_modules=sorted(linear) or None,
        target_parameters=sorted(expert) or None,
        bias="none",
    )
    return config.to_dict()
