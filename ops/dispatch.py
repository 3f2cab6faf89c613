"""Pick one implementation of an op, loudly.

Each op package (`verl_moe.ops.<op>`) holds `IMPLS = {"torch": "module:function", ...}`,
imported lazily. The choice is: the explicit `impl` argument (from config), else
`VERL_MOE_OPS` (`triton`, or per op `gdn=fla,norm=torch`), else the device default
(cuda/npu -> the op's `ACCELERATOR_DEFAULT`, else triton when the op has one;
cpu -> torch). An unknown or unrunnable choice
raises ValueError listing the choices: no silent fallback.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
from collections.abc import Callable

from . import device
from .common import runtime

logger = logging.getLogger(__name__)

# Implementations that come from other projects (the `bench` extra), cuda only.
ANCHOR_PACKAGES = {"fla": "fla", "liger": "liger_kernel"}


def _env_choice(op: str) -> str | None:
    value = os.environ.get("VERL_MOE_OPS", "").strip()
    if not value:
        return None
    if "=" not in value:
        return value
    pairs = dict(item.split("=", 1) for item in value.split(",") if item)
    return pairs.get(op)


def unrunnable_reason(impl: str, interpreter: bool = True) -> str | None:
    """Why `impl` ("triton", an anchor of ANCHOR_PACKAGES, or plain PyTorch code of ours) cannot run in
    this process, or None when it can. interpreter=False counts Triton only on a cuda/npu device (the
    benchmarks' shapes are far too large for TRITON_INTERPRET)."""
    if impl == "triton":
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        if not device.is_accelerator():
            if not interpreter:
                return "no cuda/npu device (these shapes are too large for the Triton interpreter)"
            if not runtime.interpreting():
                return "no cuda/npu device (set TRITON_INTERPRET=1 to run Triton kernels on CPU)"
        return None
    package = ANCHOR_PACKAGES.get(impl)
    if package is None:  # plain PyTorch code of ours: runs anywhere
        return None
    if importlib.util.find_spec(package) is None:
        return f"{package} is not installed (pip install 'verl-moe[bench]')"
    if device.device_type() != "cuda":
        return f"{impl} runs on cuda only"
    return None


def resolve(op: str, impl: str | None = None) -> Callable:
    """Return the callable implementing `op` (e.g. "gdn", "norm", "logprob").

    The choice is made on every call (so a changed `VERL_MOE_OPS` takes effect); importing and
    logging happen once per (op, implementation)."""
    package = importlib.import_module(f"verl_moe.ops.{op}")
    impls: dict[str, str] = package.IMPLS
    name = impl or _env_choice(op)
    if name is None and device.is_accelerator():
        # An op may name its accelerator default (e.g. experts -> "grouped"); else triton when present.
        name = getattr(package, "ACCELERATOR_DEFAULT", "triton" if "triton" in impls else "torch")
    name = name or "torch"
    if name not in impls:
        raise ValueError(f"op {op!r} has no implementation {name!r}; choices: {sorted(impls)}")
    reason = unrunnable_reason(name)
    if reason is not None:
        raise ValueError(f"op {op!r} implementation {name!r} cannot run here: {reason}")
    return _load(op, impls[name], name)


@functools.cache
def _load(op: str, target: str, name: str) -> Callable:
    module_name, _, attr = target.partition(":")
    fn = getattr(importlib.import_module(module_name), attr)
    logger.info("verl_moe op %s -> %s (%s)", op, name, target)
    return fn
