"""The backends `verl-moe align` runs, in one table (`BACKENDS`: name -> `Backend`).

- `reference` (`reference.py`): the model spec in fp64, eager, single process; log-probs and
  entropy from full fp64 logits (not the fused op), verl's `ppo_loss`, torch AdamW with verl's LR
  schedule.
- `fsdp2` (`engine.py`): our `MoeFsdp2Engine` through verl's engine contract on `world` ranks
  (gloo on CPU), launched with torchrun (`launch.py`).
- `veomni` (`engine.py`): our `MoeVeOmniEngine` (VeOmni's parallel state), launched like fsdp2;
  option `ep=N` splits the routed experts over N ranks (expert parallelism).
- `megatron` (`megatron.py`): megatron-core's `GPTModel` on its local layer specs from the
  converted HF weights (GPU only); reported as skipped with the reason where it cannot run.

A backend is named `name[:key=value[:key=value...]]`; keys: `dtype` (fp64|fp32|bf16),
`router` (bf16|fp32|fp64: the router's compute dtype), `world` (ranks), `ep` (veomni: expert-
parallel size), `replay` (R2|R3: router replay, see `BackendSpec`; not megatron), and
`cfg.<field>[.<subfield>]=<json>` to perturb the HF config the backend builds from (e.g.
`reference:cfg.rope_parameters.partial_rotary_factor=0.5`, a wrong rotary dim).
"""

from __future__ import annotations

import json

from . import engine, megatron, reference
from .spec import DTYPES, Backend, BackendSpec

REPLAY_MODES = ("R2", "R3")

__all__ = ["BACKENDS", "DTYPES", "REPLAY_MODES", "Backend", "BackendSpec", "parse_backend", "unavailable"]

# engines train in bf16 on an accelerator, fp32 on CPU
BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("reference", ("fp64", "fp64"), False, reference.unavailable, reference.run_reference, ("replay",)),
        Backend("fsdp2", ("bf16", "fp32"), True, engine.fsdp2_unavailable, engine.run_fsdp2_rank, ("replay",)),
        Backend("veomni", ("bf16", "fp32"), True, engine.veomni_unavailable, engine.run_veomni_rank, ("ep", "replay")),
        Backend("megatron", ("bf16", "bf16"), True, megatron.megatron_unavailable, megatron.run_megatron_rank),
    )
}


def parse_backend(text: str) -> BackendSpec:
    """`name[:key=value...]` -> BackendSpec; ValueError on an unknown name, key or value."""
    name, *options = text.strip().split(":")
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r} in {text!r}; choices: {list(BACKENDS)}")
    backend = BACKENDS[name]
    kw: dict = {}
    overrides = []
    for opt in options:
        key, sep, value = opt.partition("=")
        if not sep:
            raise ValueError(f"backend option {opt!r} in {text!r} must be key=value")
        if key in ("dtype", "router"):
            if value not in DTYPES:
                raise ValueError(f"{key}={value!r} in {text!r}: choose from {list(DTYPES)}")
            kw[key] = value
        elif key in ("world", "ep"):
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"{key}={value!r} in {text!r} must be a positive integer")
            if key == "ep" and key not in backend.options:
                raise ValueError(f"ep= in {text!r}: expert parallelism is a veomni engine option")
            kw[key] = int(value)
        elif key == "replay":
            if value not in REPLAY_MODES:
                raise ValueError(f"replay={value!r} in {text!r}: choose from {list(REPLAY_MODES)}")
            if key not in backend.options:
                raise ValueError(f"replay= in {text!r}: router replay is not offered by the {name} backend")
            kw[key] = value
        elif key.startswith("cfg."):
            json.loads(value)  # must be a JSON literal
            overrides.append((key[4:], value))
        else:
            raise ValueError(
                f"unknown backend option {key!r} in {text!r}; keys: dtype, router, world, ep, replay, cfg.<field>"
            )
    return BackendSpec(backend=backend, overrides=tuple(overrides), **kw)


def unavailable(spec: BackendSpec) -> str | None:
    """Why `spec` cannot run on this machine, or None when it can."""
    return spec.backend.unavailable(spec)
