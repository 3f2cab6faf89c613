"""Every piece of process-wide state verl_moe's ops keep, in one place.

Ops are pure functions of their arguments except for what is listed here; nothing else in `ops/`
holds a module-level cache or reads a switch from the environment at call time (the user-facing
`VERL_MOE_OPS`, read by `dispatch.resolve`, and `VERL_MOE_DEVICE` / `VERL_MOE_DISABLE_NPU`, by
`device`, aside).

Switches (read on every call, never at import):
- deterministic mode (`deterministic` / `set_deterministic`): every Triton kernel launches its first
  config instead of autotuning, so two processes given the same inputs run the same reductions in
  the same order. The engines turn it on under verl's `full_determinism`; a user or a script may set
  `VERL_MOE_DETERMINISTIC=1`. It is stored in that environment variable on purpose: processes the
  engine's process starts afterwards (workers, spawned ranks) inherit it, as they inherit the other
  variables verl's `enable_full_determinism` sets.
- the Triton interpreter (`interpreting`): `TRITON_INTERPRET=1`. Triton itself reads it when a kernel
  module is first imported (`triton.jit`), so it must be set before any kernel module is imported
  (tests/conftest.py does); changing it later does not switch kernels already imported.

Cache (keyed so that a stale entry is never returned; `clear_caches` empties it):
- `AUTOTUNE_PICKS`: (kernel, deterministic mode, the configs offered, key argument values, tensor dtypes)
  -> the config the autotuner picked (`launch.launch`): later launches skip the autotuner's per-call host
  bookkeeping.
"""

from __future__ import annotations

import os

DETERMINISTIC_ENV = "VERL_MOE_DETERMINISTIC"
INTERPRET_ENV = "TRITON_INTERPRET"

AUTOTUNE_PICKS: dict[tuple, dict] = {}


def deterministic() -> bool:
    """True when our kernels must pick the same configuration in every process (see the module docstring)."""
    return os.environ.get(DETERMINISTIC_ENV) == "1"


def set_deterministic(enabled: bool = True) -> None:
    """Turn deterministic mode on (or off) for this process and the processes it starts afterwards."""
    if enabled:
        os.environ[DETERMINISTIC_ENV] = "1"
    else:
        os.environ.pop(DETERMINISTIC_ENV, None)


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (`TRITON_INTERPRET=1`, CPU tests)."""
    return os.environ.get(INTERPRET_ENV) == "1"


def clear_caches() -> None:
    """Forget every autotune pick (the next launch autotunes again)."""
    AUTOTUNE_PICKS.clear()
