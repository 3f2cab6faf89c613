"""What a backend is (`Backend`, one row of the table in `backends/__init__.py`) and a parsed
backend name (`BackendSpec`: the row plus the options the name gives)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Backend:
    """One backend `verl-moe align` can run.

    default_dtype: compute dtype when the name gives none, (on an accelerator, on CPU).
    launched: True: `world` ranks under torchrun (`launch.py` starts them); False: in the align
        process itself, one rank. unavailable(spec): why it cannot run here, or None.
    run(job, spec, progress): the backend's training run (one rank of it when launched); returns
        the `BackendTrace` on rank 0, None on the other ranks.
    options: option keys only this backend takes (besides dtype, router, world, cfg.<field>).
    """

    name: str
    default_dtype: tuple[str, str]
    launched: bool
    unavailable: Callable[[BackendSpec], str | None]
    run: Callable
    options: tuple[str, ...] = ()


@dataclass(frozen=True)
class BackendSpec:
    """A parsed backend name. dtype / router / world / ep are None where the backend's default applies;
    replay: router replay ("R2": replay the backend's own θ0 routes of each batch in every update,
    "R3": replay the fp64 reference's θ0 routes, the rollout's stand-in) or None (free routing)."""

    backend: Backend = field(repr=False)
    dtype: str | None = None
    router: str | None = None
    world: int | None = None
    ep: int | None = None  # expert-parallel size (veomni)
    replay: str | None = None
    overrides: tuple[tuple[str, str], ...] = ()

    def __repr__(self) -> str:
        return f"BackendSpec({self.label!r})"

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def label(self) -> str:
        parts = [self.name]
        options = (
            ("dtype", self.dtype),
            ("router", self.router),
            ("world", self.world),
            ("ep", self.ep),
            ("replay", self.replay),
        )
        parts += [f"{k}={v}" for k, v in options if v]
        parts += [f"cfg.{k}={v}" for k, v in self.overrides]
        return ":".join(parts)

    @property
    def compute_dtype(self) -> str:
        from verl_moe.ops import device

        on_accelerator, on_cpu = self.backend.default_dtype
        return self.dtype or (on_accelerator if device.is_accelerator() else on_cpu)

    @property
    def router_dtype(self) -> str:
        """The router dtype this backend runs with (fp32, or fp64 in an fp64 model, by default)."""
        return self.router or ("fp64" if self.compute_dtype == "fp64" else "fp32")

    def ops_config(self):
        """OpsConfig for the model spec, carrying this backend's router dtype."""
        from verl_moe.models import OpsConfig

        try:
            return OpsConfig(router_dtype=self.router_dtype)
        except ValueError as e:
            raise ValueError(
                f"backend {self.label}: router dtype {self.router_dtype} is not offered by OpsConfig ({e})"
            ) from e

    def settings(self, world: int) -> dict:
        """The `BackendTrace.settings` of a run of this backend on `world` ranks."""
        return {
            "name": self.name,
            "dtype": self.compute_dtype,
            "router_dtype": self.router_dtype,
            "world_size": world,
            "router_replay": self.replay,
            "overrides": [f"{k}={v}" for k, v in self.overrides],
        }
