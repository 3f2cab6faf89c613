"""`MoeEngineDispatch`: the EngineRegistry entry that picks our engine or verl's, per model type.

verl calls `engine_cls(model_config=..., engine_config=..., optimizer_config=...,
checkpoint_config=...)`. The dispatcher's `__new__` returns the engine chosen by
`resolve_engine_class`, fully constructed (Python then skips the dispatcher's own `__init__`,
since the object is not an instance of it). Imported by `plugin.register_engines` only after the
cpu platform is registered, because importing `verl.workers.engine` resolves verl's platform.
"""

from __future__ import annotations

import logging
import os

from verl.utils.device import get_device_name
from verl.workers.engine import BaseEngine, EngineRegistry

logger = logging.getLogger(__name__)

ROLE = "language_model"
SERVED_BACKENDS = ("fsdp", "fsdp2", "veomni")


def supported_model_types() -> frozenset[str]:
    """HF `model_type`s that verl_moe has a model spec for."""
    from verl_moe.models.registry import SPECS

    return frozenset(SPECS)


def engine_device() -> str:
    """The device key verl's registry looks up (honouring VERL_ENGINE_DEVICE as verl does)."""
    return os.environ.get("VERL_ENGINE_DEVICE") or get_device_name()


def resolve_engine_class(model_config, backend: str) -> type[BaseEngine]:
    """The engine class that serves `model_config` for `backend` on this process's device.

    Ours when `model_config.hf_config.model_type` has a spec in `verl_moe.models.registry`
    (`MoeVeOmniEngine` for "veomni", `MoeFsdp2Engine` for "fsdp" / "fsdp2");
    otherwise verl's built-in engine under the device-only registry key. Raises ValueError
    naming the model type when neither exists (e.g. a non-MoE model on the cpu platform,
    where verl registers no FSDP engine) or when `backend` is not one we serve.
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
    device = engine_device()
    # Read-only look-up of verl's own entry: the device-only key, which we never write on cuda/npu.
    builtin = EngineRegistry._engines.get(ROLE, {}).get(backend, {}).get(device)
    if builtin is None or builtin is MoeEngineDispatch:
        raise ValueError(
            f"model type {hf_model_type!r} has no verl_moe spec (supported: {sorted(supported_model_types())}) "
            f"and verl has no built-in {backend!r} engine on device {device!r}"
        )
    return builtin


class MoeEngineDispatch(BaseEngine):
    """Constructs `resolve_engine_class(model_config, engine_config.strategy)` with verl's arguments."""

    def __new__(cls, model_config, engine_config, optimizer_config, checkpoint_config):
        engine_cls = resolve_engine_class(model_config, engine_config.strategy)
        logger.info("verl_moe: %s (%s) -> %s", model_config.hf_config.model_type, engine_config.strategy, engine_cls)
        return engine_cls(
            model_config=model_config,
            engine_config=engine_config,
            optimizer_config=optimizer_config,
            checkpoint_config=checkpoint_config,
        )
