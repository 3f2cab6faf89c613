"""Engine configuration: verl's `FSDPEngineConfig` / `VeOmniEngineConfig` plus verl_moe's knobs,
the layout both engines read from either, and the checks that run before any model is built.

`MoeFsdp2EngineConfig` is what `configs/engine/moe_fsdp2.yaml` instantiates (field for field)
into `actor_rollout_ref.actor.fsdp_config`; `MoeVeOmniEngineConfig` likewise from
`configs/engine/moe_veomni.yaml` (`model_engine=veomni`). verl's own configs are accepted too
(our engines then use `OpsConfig()` defaults), so a run that only switches the model keeps
working. verl's `BaseConfig` makes every field read-only except the few verl itself assigns
(`use_dynamic_bsz`, micro-batch sizes, ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from verl.utils.torch_dtypes import PrecisionType
from verl.workers.config import FSDPEngineConfig, VeOmniEngineConfig
from verl_moe.models import ArchConfig, OpsConfig, build, get_spec
from verl_moe.models.activation_offload import select_layers
from verl_moe.models.fsdp_plan import decoder_layer_names
from verl_moe.models.lora import ALL_LINEAR, LoraSettings, resolve_targets

SERVED_STRATEGIES = ("fsdp", "fsdp2", "veomni")


@dataclass
class MoeFsdp2EngineConfig(FSDPEngineConfig):
    """verl's FSDP engine config plus the ops our spec uses.

    Fields read by MoeFsdp2Engine (all others are verl's and keep verl's meaning):
        strategy: "fsdp2" (or "fsdp": both run on FSDP2 `fully_shard`).
        fsdp_size: ranks per shard group; -1 = the whole world, smaller = hybrid shard
            (replicate across groups).
        model_dtype: master-weight dtype ("fp32").
        mixed_precision: {"param_dtype", "reduce_dtype"} ("bf16"/"fp32"); None = bf16 / fp32.
            The router always computes and reduces in fp32.
        reshard_after_forward, param_offload, optimizer_offload, offload_policy: as in verl.
        ulysses_sequence_parallel_size: Ulysses SP group size; must divide the world, the query
            heads and the GatedDeltaNet key / value heads (attention kv heads may also divide it:
            they are then repeated).
        use_no_sync_for_gradient_accumulation: reduce-scatter once per mini-batch.
        ops: implementation per op and the router dtype (`verl_moe.models.OpsConfig`).
        freeze_vision_tower: a vision-language model's tower gets no gradient and is not in the
            optimizer (verl's `actor.freeze_vision_tower`, which verl does not pass to engines).
        text_only: a vision-language checkpoint trains its text decoder alone: no tower parameters,
            optimizer state or tower passes, `model.visual.*` skipped at load and absent from exports
            (for text-only data; the default runs the tower in every forward).
    Read from verl's model config: enable_gradient_checkpointing (per decoder layer and ViT block) and
    enable_activation_offload (each decoder layer's saved tensors, its inputs under checkpointing, wait
    for backward in host memory: `models/activation_offload.py`), LoRA (both engines: `lora_settings`,
    `lora_merge`, `models/lora.py`) and MTP (`model.mtp`: `mtp_loss_scale`, `engines/mtp_loss.py`).
    """

    strategy: str = "fsdp2"
    ops: OpsConfig = field(default_factory=OpsConfig)
    freeze_vision_tower: bool = False
    text_only: bool = False


@dataclass
class MoeVeOmniEngineConfig(VeOmniEngineConfig):
    """verl's VeOmni engine config (what `model_engine=veomni` builds) plus the ops our spec uses.

    Fields read by MoeVeOmniEngine (all others are verl's and keep verl's meaning; the
    implementation selectors for VeOmni's own HF models are ignored: our spec uses `ops`):
        fsdp_size: data-parallel ranks per shard group; -1 = all, smaller = hybrid shard.
        ulysses_parallel_size: Ulysses SP group size (same divisibility rules as the fsdp2 engine).
        expert_parallel_size: ranks the routed experts are split over (must divide the
            sharding ranks and num_experts); the experts are then sharded over the rest.
        mixed_precision: True = fp32 master weights, `param_dtype` compute, fp32 gradient
            reduction; False = bf16 weights and compute (as verl's VeOmni engine).
        param_dtype: compute dtype under mixed precision ("bf16" or "fp32").
        enable_fsdp_offload: FSDP2 CPUOffloadPolicy; param_offload / optimizer_offload: as in verl.
        enable_async_activation_offload: each decoder layer's saved tensors (its inputs under
            checkpointing) go to host memory on a side stream and are prefetched back ahead of
            backward (`models/activation_offload.py`); model.enable_activation_offload is refused, as
            verl's VeOmni engine does.
        activation_offload_modules: which decoder layers, as VeOmni's name patterns ("model.layers.{*}",
            "model.layers.3"); empty = all. A pattern matching no decoder layer is refused.
        activation_offload_host_cache_limit_gb: only the default (4.0): pinned buffers come from torch's
            caching host allocator, which reuses them across steps without a separate bound.
        ops: implementation per op and the router dtype (`verl_moe.models.OpsConfig`).
        freeze_vision_tower, text_only: as in MoeFsdp2EngineConfig.
    LoRA comes from verl's model config as for MoeFsdp2EngineConfig (the expert factors split over EP).
    """

    strategy: str = "veomni"
    mixed_precision: bool = True
    param_dtype: str = "bf16"
    ops: OpsConfig = field(default_factory=OpsConfig)
    freeze_vision_tower: bool = False
    text_only: bool = False


@dataclass(frozen=True)
class EngineLayout:
    """What the engines read from either config: sharding, sequence/expert parallel sizes,
    FSDP2 CPU offload, whether gradient reduction waits for the last micro-batch, and activation
    offload (model_config.enable_activation_offload for fsdp2, enable_async_activation_offload for
    veomni) with the decoder-layer patterns it applies to (empty = all)."""

    fsdp_size: int
    sequence_parallel_size: int
    expert_parallel_size: int
    reshard_after_forward: bool
    fsdp_cpu_offload: bool
    defer_grad_sync: bool
    activation_offload: bool = False
    activation_offload_modules: tuple[str, ...] = ()


DEFAULT_HOST_CACHE_LIMIT_GB = 4.0  # VeOmniEngineConfig.activation_offload_host_cache_limit_gb's default


def engine_layout(engine_config: FSDPEngineConfig | VeOmniEngineConfig, model_config=None) -> EngineLayout:
    """The layout of `engine_config`; `model_config` (verl's HFModelConfig) carries the fsdp2 engine's
    activation-offload switch: without it (checks that need only the sizes) offload reads as off."""
    if isinstance(engine_config, VeOmniEngineConfig):
        return EngineLayout(
            fsdp_size=engine_config.fsdp_size,
            sequence_parallel_size=engine_config.ulysses_parallel_size,
            expert_parallel_size=engine_config.expert_parallel_size,
            reshard_after_forward=True,  # VeOmni always reshards decoder layers after forward
            fsdp_cpu_offload=engine_config.enable_fsdp_offload,
            defer_grad_sync=True,
            activation_offload=engine_config.enable_async_activation_offload,
            activation_offload_modules=tuple(engine_config.activation_offload_modules),
        )
    return EngineLayout(
        fsdp_size=engine_config.fsdp_size,
        sequence_parallel_size=engine_config.ulysses_sequence_parallel_size,
        expert_parallel_size=1,
        reshard_after_forward=engine_config.reshard_after_forward,
        fsdp_cpu_offload=engine_config.offload_policy,
        defer_grad_sync=engine_config.use_no_sync_for_gradient_accumulation,
        activation_offload=model_config is not None and model_config.enable_activation_offload,
    )


def ops_config(engine_config: FSDPEngineConfig | VeOmniEngineConfig) -> OpsConfig:
    """The ops of our configs (a mapping from YAML becomes an OpsConfig, unknown keys a ValueError), or
    the defaults for a plain verl config."""
    if isinstance(engine_config, MoeFsdp2EngineConfig | MoeVeOmniEngineConfig):
        return OpsConfig.coerce(engine_config.ops)
    return OpsConfig()


def vision_switch(engine_config: FSDPEngineConfig | VeOmniEngineConfig, name: str) -> bool:
    """Our configs' vision-language switch `name` (`freeze_vision_tower`, `text_only`); False for a
    plain verl config (it has no such fields)."""
    return isinstance(engine_config, MoeFsdp2EngineConfig | MoeVeOmniEngineConfig) and getattr(engine_config, name)


def mtp_switches(model_config) -> tuple[bool, bool, float, bool]:
    """verl's `model_config.mtp` (`MtpConfig`) as (enable, enable_train, mtp_loss_scaling_factor,
    detach_encoder); all off for a model config without one (a stand-in holding only other fields)."""
    mtp = getattr(model_config, "mtp", None)
    if mtp is None:
        return False, False, 0.0, False
    return bool(mtp.enable), bool(mtp.enable_train), float(mtp.mtp_loss_scaling_factor), bool(mtp.detach_encoder)


def mtp_loss_scale(model_config) -> float:
    """The MTP loss factor of verl's `model_config.mtp`: its `mtp_loss_scaling_factor` when `enable_train`
    is on, else 0.0 (no MTP loss). `mtp.enable` alone keeps the MTP layers in the model (loaded, saved,
    exported) without training them; verl zeroes the config's MTP layer count otherwise."""
    _, train, scale, _ = mtp_switches(model_config)
    return scale if train else 0.0


def _check_mtp(model_config, arch: ArchConfig, sequence_parallel: int) -> None:
    """verl's `model_config.mtp` against the model: MTP on needs MTP layers; training them needs MTP on, a
    finite factor >= 0 and no sequence parallelism (a rank's slice would need the next rank's tokens for
    its shift). Raises ValueError."""
    enable, train, scale, _ = mtp_switches(model_config)
    if enable and not arch.mtp_num_hidden_layers:
        raise ValueError("model.mtp.enable=true needs a config with MTP layers (mtp_num_hidden_layers > 0), got 0")
    if not train:
        return
    if not enable:
        raise ValueError("model.mtp.enable_train=true needs model.mtp.enable=true (the MTP layers in the model)")
    if not math.isfinite(scale) or scale < 0:
        raise ValueError(f"model.mtp.mtp_loss_scaling_factor={scale} must be finite and >= 0")
    if sequence_parallel > 1:
        raise ValueError(
            f"model.mtp.enable_train is not supported with sequence parallelism (size {sequence_parallel})"
        )


def precision_dtypes(
    engine_config: FSDPEngineConfig | VeOmniEngineConfig,
) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """(master dtype, compute dtype, gradient-reduce dtype)."""
    if isinstance(engine_config, VeOmniEngineConfig):
        if not engine_config.mixed_precision:
            return torch.bfloat16, torch.bfloat16, torch.bfloat16
        param_dtype = getattr(engine_config, "param_dtype", "bf16")
        if param_dtype not in ("bf16", "fp32"):
            raise ValueError(f"param_dtype={param_dtype!r}: the compute dtype under mixed precision is bf16 or fp32")
        return torch.float32, PrecisionType.to_dtype(param_dtype), torch.float32
    master = PrecisionType.to_dtype(engine_config.model_dtype)
    mixed = engine_config.mixed_precision or {}
    unknown = set(mixed) - {"param_dtype", "reduce_dtype", "buffer_dtype"}
    if unknown:
        raise ValueError(f"mixed_precision has unknown keys {sorted(unknown)}")
    compute = PrecisionType.to_dtype(mixed.get("param_dtype", "bf16"))
    reduce = PrecisionType.to_dtype(mixed.get("reduce_dtype", "fp32"))
    return master, compute, reduce


def arch_config(hf_config) -> ArchConfig:
    """The validated architecture of an HF config (raises naming the supported model types)."""
    spec = get_spec(hf_config.model_type)
    return spec.arch_config(spec.text_config(hf_config))


def validate_engine_config(model_config, engine_config, world_size: int) -> None:
    """Raise ValueError on a configuration our engines cannot run, before any model is built. Tied word
    embeddings (hf_config.tie_word_embeddings) run with every layout: full or hybrid FSDP2 shard, expert
    and Ulysses parallelism (the shared weight is one root-unit parameter, `models/fsdp_plan.py`)."""
    if engine_config.strategy not in SERVED_STRATEGIES:
        raise ValueError(
            f"unknown strategy {engine_config.strategy!r} for verl_moe; expected one of {SERVED_STRATEGIES}"
        )
    arch = arch_config(model_config.hf_config)
    ops_config(engine_config)  # a bad ops key fails here, not at initialize
    layout = engine_layout(engine_config)
    sp = layout.sequence_parallel_size
    if sp < 1 or world_size % sp:
        raise ValueError(f"ulysses sequence-parallel size {sp} must divide the world size {world_size}")
    bad = arch.sequence_parallel_problems(sp)
    if bad:
        raise ValueError(f"ulysses sequence-parallel size {sp} does not divide the head counts {bad}")
    _check_mtp(model_config, arch, sp)
    # the fsdp2 engine shards over world ranks, the veomni engine over data-parallel ranks
    veomni = isinstance(engine_config, VeOmniEngineConfig)
    shard_world = world_size // sp if veomni else world_size
    fsdp_size = layout.fsdp_size
    if fsdp_size != -1 and (fsdp_size < 1 or shard_world % min(fsdp_size, shard_world)):
        raise ValueError(f"fsdp_size={fsdp_size} must be -1 or divide {shard_world} ranks")
    ep = layout.expert_parallel_size
    if ep != 1:
        shard_group = world_size if fsdp_size == -1 or fsdp_size >= shard_world else fsdp_size * sp
        if ep < 1 or shard_group % ep:
            raise ValueError(f"expert_parallel_size={ep} must divide the {shard_group} ranks one shard group spans")
        if arch.num_experts % ep:
            raise ValueError(f"expert_parallel_size={ep} does not divide num_experts={arch.num_experts}")
    for name in (
        "micro_batch_size_per_gpu",
        "infer_micro_batch_size_per_gpu",
        "max_token_len_per_gpu",
        "infer_max_token_len_per_gpu",
    ):
        value = getattr(engine_config, name)
        if value is not None and value < 1:
            raise ValueError(f"{name}={value} must be positive")
    precision_dtypes(engine_config)
    if engine_config.param_offload and layout.fsdp_cpu_offload:
        raise ValueError("param_offload (between steps) and FSDP2 CPU offload (offload_policy) are exclusive")
    if engine_config.router_replay.mode == "R3" and arch.num_experts_per_tok < 2:
        # R3 marks the rollout's unrecorded tokens by repeated ids (verl's convention): one id cannot repeat
        raise ValueError(f"router_replay.mode='R3' needs num_experts_per_tok >= 2, got {arch.num_experts_per_tok}")
    if engine_config.pad_to_length:
        raise ValueError("pad_to_length is not supported by verl_moe's engines")
    if veomni:
        _check_async_activation_offload(model_config, engine_config)
        if engine_config.qat_implementation != "none":
            raise ValueError("QAT is not supported by MoeVeOmniEngine (qat_implementation)")
    elif engine_config.qat.enable:
        raise ValueError("QAT is not supported by MoeFsdp2Engine (qat.enable)")
    settings = lora_settings(model_config)
    if settings is not None and ops_config(engine_config).exact:
        raise ValueError(
            f"LoRA (model.lora_rank={settings.rank}) cannot run in exact mode (ops.exact=true): its adapter "
            "matmuls have no exact form; set lora_rank=0 or ops.exact=false"
        )
    offload_patterns = ()
    if veomni and engine_config.enable_async_activation_offload:
        offload_patterns = tuple(engine_config.activation_offload_modules)
    if settings is not None or offload_patterns:
        # LoRA targets and offload patterns must name modules of what the engine builds: that model on meta
        text_only = vision_switch(engine_config, "text_only")
        meta = build(model_config.hf_config, device="meta", text_only=text_only)
        if settings is not None:
            resolve_targets(meta, settings)
        if offload_patterns:
            select_layers(decoder_layer_names(meta), offload_patterns)


def lora_settings(model_config) -> LoraSettings | None:
    """verl's LoRA keys of `model_config` (HFModelConfig: lora_rank, lora_alpha, target_modules as a list or
    "all-linear", target_parameters, exclude_modules as a regex or a list) as `models.lora.LoraSettings`;
    None when lora_rank is 0. Raises ValueError for lora_rank < 0 and for lora_adapter_path (loading a
    trained adapter is not supported)."""
    rank = model_config.lora_rank
    if rank < 0:
        raise ValueError(f"lora_rank={rank} must be >= 0 (0: no LoRA)")
    if rank == 0:
        return None
    if model_config.lora_adapter_path is not None:
        raise ValueError("lora_adapter_path is not supported by verl_moe's engines (LoRA starts from B = 0)")
    targets = model_config.target_modules
    targets = (
        ALL_LINEAR if targets in (None, ALL_LINEAR) else (targets,) if isinstance(targets, str) else tuple(targets)
    )
    exclude = model_config.exclude_modules
    exclude = exclude if exclude is None or isinstance(exclude, str) else tuple(exclude)
    return LoraSettings(
        rank=rank,
        alpha=model_config.lora_alpha,
        target_modules=targets,
        target_parameters=tuple(model_config.target_parameters or ()),
        exclude_modules=exclude,
    )


def lora_merge(model_config) -> bool:
    """verl's `model_config.lora.merge`: the rollout gets base + scale * B A under the base names (True) or
    the adapters under peft's names with a peft config (False, verl's default)."""
    return bool((model_config.lora or {}).get("merge", False))


def _check_async_activation_offload(model_config, engine_config: VeOmniEngineConfig) -> None:
    """VeOmni's activation-offload options that MoeVeOmniEngine cannot honour raise ValueError (its layer
    patterns are checked against the model in `validate_engine_config`)."""
    if model_config.enable_activation_offload:
        raise ValueError(
            "model.enable_activation_offload is not supported by MoeVeOmniEngine (verl's VeOmniEngineConfig "
            "documents it as rejected); use enable_async_activation_offload"
        )
    if engine_config.activation_offload_host_cache_limit_gb != DEFAULT_HOST_CACHE_LIMIT_GB:
        raise ValueError(
            f"activation_offload_host_cache_limit_gb={engine_config.activation_offload_host_cache_limit_gb} is not "
            f"supported by MoeVeOmniEngine: pinned buffers come from torch's caching host allocator (reused "
            f"across steps, no separate bound); leave it at {DEFAULT_HOST_CACHE_LIMIT_GB}"
        )


def validate_actor_config(actor, n_gpus: int) -> None:
    """Checks of a composed trainer's actor config (verl's `FSDPActorConfig`) that verl does not
    make, for a run on `n_gpus` ranks: the strategy, SP against the world, and a micro-batch no
    larger than the mini-batch each data-parallel rank receives. Raises ValueError."""
    engine = actor.engine
    if actor.strategy not in SERVED_STRATEGIES:
        raise ValueError(f"unknown strategy {actor.strategy!r} for verl_moe; expected one of {SERVED_STRATEGIES}")
    sp = engine_layout(engine).sequence_parallel_size
    if sp < 1 or n_gpus % sp:
        raise ValueError(f"ulysses_sequence_parallel_size={sp} must divide the number of ranks {n_gpus}")
    dp = n_gpus // sp
    sequences = actor.ppo_mini_batch_size * actor.rollout_n
    if sequences % dp:
        raise ValueError(f"ppo_mini_batch_size * rollout.n = {sequences} sequences do not split over {dp} dp ranks")
    if not actor.use_dynamic_bsz and actor.ppo_micro_batch_size_per_gpu > sequences // dp:
        raise ValueError(
            f"ppo_micro_batch_size_per_gpu={actor.ppo_micro_batch_size_per_gpu} is larger than the mini-batch "
            f"per data-parallel rank ({sequences} sequences / {dp} ranks = {sequences // dp})"
        )
