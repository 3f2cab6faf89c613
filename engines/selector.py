"""`MoeEngineSelector`: the EngineRegistry entry that picks, per model type, our engine or verl's.

verl builds an engine as `engine_cls(model_config=..., engine_config=..., optimizer_config=...,
checkpoint_config=...)` from the class its registry holds, and the registry accepts only `BaseEngine`
subclasses. The choice needs `model_config` (its HF model type), which only that call brings, so the
registered class is a factory: its `__new__` returns the chosen engine, fully constructed (Python then
skips the selector's own `__init__`, since the object is not an instance of it). Imported by
`plugin.register_engines` only after the cpu platform is registered, because importing
`verl.workers.engine` resolves verl's platform.
"""

from __future__ import annotations

import logging

from verl.workers.engine import BaseEngine, EngineRegistry

logger = logging.getLogger(__name__)

# verl's worker roles we serve: the actor and reference model, and the critic (a value head on the same spec)
ROLES = ("language_model", "value_model")
SERVED_BACKENDS = ("fsdp", "fsdp2", "veomni")

# (role, backend) -> the engine verl's registry gives this process (its device and vendor) before ours
# is registered: what every model type without a spec of ours gets. Filled by `record_verl_engines`.
VERL_ENGINES: dict[tuple[str, str], type[BaseEngine]] = {}


def supported_model_types() -> frozenset[str]:
    """HF `model_type`s that verl_moe has a model spec for."""
    from verl_moe.models.registry import SPECS

    return frozenset(SPECS)


def record_verl_engines() -> None:
    """Note verl's own engine for each served role and backend (`EngineRegistry.get_engine_cls`,
    honouring VERL_ENGINE_DEVICE / VERL_ENGINE_VENDOR as verl does). Called before our class is
    registered, so the look-up cannot return it; a pair verl serves nothing for here (e.g. on the
    cpu platform) stays absent."""
    for role in ROLES:
        for backend in SERVED_BACKENDS:
            try:
                VERL_ENGINES[role, backend] = EngineRegistry.get_engine_cls(role, backend)
            except (AssertionError, ValueError):  # verl's "unknown backend" / "no engine for this device"
                VERL_ENGINES.pop((role, backend), None)


def select_engine_class(model_config, backend: str) -> type[BaseEngine]:
    """The engine class that serves `model_config` for `backend` in this process.

    Ours when `model_config.hf_config.model_type` has a spec in `verl_moe.models.registry`
    (`MoeVeOmniEngine` for "veomni", `MoeFsdp2Engine` for "fsdp" / "fsdp2"; for verl's critic, role
    `value_model`, the same classes build the spec with a value head); otherwise verl's engine for the
    role (`model_config.model_type`, which verl's TrainingWorker sets) and backend (`VERL_ENGINES`).
    Raises ValueError naming the model type when neither exists (e.g. a non-MoE model on the cpu
    platform, where verl registers no FSDP engine) or when `backend` is not one we serve.
    """
    if backend not in SERVED_BACKENDS:
        raise ValueError(f"verl_moe serves backends {list(SERVED_BACKENDS)}, got {backend!r}")
    hf_model_type = model_config.hf_config.model_type
    if hf_model_type in supported_model_types():
        if backend == "veomni":
            from verl_moe.engines.veomni import MoeVeOmniEngine

            return MoeVeOmniEngine
        from verl_moe.engines.fsdp2 import MoeFsdp2Engine

        return MoeFsdp2Engine
    verl_engine = VERL_ENGINES.get((model_config.model_type, backend))
    if verl_engine is None:
        raise ValueError(
            f"model type {hf_model_type!r} has no verl_moe spec (supported: {sorted(supported_model_types())}) "
            f"and verl has no built-in {backend!r} engine for {model_config.model_type!r} on this device"
        )
    return verl_engine


class MoeEngineSelector(BaseEngine):
    """Constructs `select_engine_class(model_config, engine_config.strategy)` with verl's arguments."""

    def __new__(cls, model_config, engine_config, optimizer_config, checkpoint_config):
        engine_cls = select_engine_class(model_config, engine_config.strategy)
        logger.info("verl_moe: %s (%s) -> %s", model_config.hf_config.model_type, engine_config.strategy, engine_cls)
        return engine_cls(
            model_config=model_config,
            engine_config=engine_config,
            optimizer_config=optimizer_config,
            checkpoint_config=checkpoint_config,
        )
