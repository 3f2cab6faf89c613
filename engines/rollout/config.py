"""Our rollout's own settings: `actor_rollout_ref.rollout.engine_kwargs.verl_moe` (verl keeps one
`engine_kwargs` mapping per rollout backend, e.g. `engine_kwargs.vllm`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

ROLLOUT_NAME = "verl_moe"
# verl's rollout config, where refusals point a user
ROLLOUT_KEY = "actor_rollout_ref.rollout"
OPTIONS_KEY = f"{ROLLOUT_KEY}.engine_kwargs.{ROLLOUT_NAME}"
# verl's MTP switches (`MtpConfig`); the rollout config's `mtp` is this group
MTP_KEY = "actor_rollout_ref.model.mtp"
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True)
class RolloutOptions:
    """Attributes:
    steps_per_call: tokens each running sequence advances per engine call; new requests join the
        running batch between calls (continuous batching at this granularity).
    batch_wait_ms: how long the server lets requests gather before it starts an idle engine.
    ops: the rollout model's op choices (`verl_moe.models.OpsConfig` fields), None for auto.
    sync_every: decode steps between two reads of the decode slots by the host (finished requests
        leave, and their slots free, at these reads).
    max_prefill_tokens: prompt tokens per packed prefill forward (bounds the prefill's activations).
    device_graphs: run each decode step as one captured device graph (cuda / npu); None: for a bf16 or
        fp32 rollout on cuda, unless the rollout config's `enforce_eager` (npu: not run, opt in with true).
    speculative_tokens: k > 0 decodes with the model's MTP layer drafting k tokens per round, verified by
        the model (`speculative.py::SpeculativeEngine`: temperature and greedy sampling only); 0: off.
        verl's `actor_rollout_ref.model.mtp.enable_rollout=true` (with `mtp.enable`) sets it to
        `mtp.num_speculative_tokens` (see `from_rollout_config`).
    max_speculative: with speculative_tokens, an engine call's new requests decode speculatively when at
        most this many requests run with them, else in the plain engine (device_graphs applies to both;
        `routing.py`); 0: never speculate, max_num_seqs or more: always.
    """

    steps_per_call: int = 16
    batch_wait_ms: float = 10.0
    ops: Mapping | None = None
    sync_every: int = 8
    device_graphs: bool | None = None
    max_prefill_tokens: int = 32768
    speculative_tokens: int = 0
    max_speculative: int = 32

    def __post_init__(self):
        if self.steps_per_call < 1:
            raise ValueError(f"{OPTIONS_KEY}.steps_per_call must be >= 1, got {self.steps_per_call}")
        for name in ("sync_every", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{OPTIONS_KEY}.{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_wait_ms < 0:
            raise ValueError(f"{OPTIONS_KEY}.batch_wait_ms must be >= 0, got {self.batch_wait_ms}")
        if self.speculative_tokens < 0:
            raise ValueError(f"{OPTIONS_KEY}.speculative_tokens must be >= 0 (0: off), got {self.speculative_tokens}")
        if self.max_speculative < 0:
            raise ValueError(f"{OPTIONS_KEY}.max_speculative must be >= 0, got {self.max_speculative}")
        if self.speculative_tokens and self.ops is not None and self.ops.get("exact"):
            raise ValueError(
                f"{OPTIONS_KEY}.speculative_tokens is not exact (its verification runs k + 1 positions at once): "
                f"turn off {OPTIONS_KEY}.ops.exact or speculation"
            )

    @classmethod
    def from_rollout_config(cls, config: Any) -> RolloutOptions:
        """From a verl RolloutConfig (or anything with `engine_kwargs`). Unknown keys raise ValueError
        listing the valid ones. verl's MTP rollout switch (the config's `mtp`, verl's `MtpConfig`): with
        `enable_rollout` and `enable`, method "mtp", speculative_tokens is `num_speculative_tokens` (ours,
        when also given, must agree); `enable_rollout` without `enable` or another method is refused."""
        values = dict((getattr(config, "engine_kwargs", None) or {}).get(ROLLOUT_NAME) or {})
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(valid))
        if unknown:
            raise ValueError(f"{OPTIONS_KEY}: unknown key(s) {unknown}; valid: {valid}")
        if values.get("ops") is not None:
            values["ops"] = dict(values["ops"])
        mtp = getattr(config, "mtp", None)
        if mtp is not None and mtp.enable_rollout:
            if not mtp.enable:
                raise ValueError(f"{MTP_KEY}.enable_rollout needs {MTP_KEY}.enable=true (the model's MTP layer)")
            if mtp.method != "mtp":
                raise ValueError(f"{MTP_KEY}.method={mtp.method!r}: verl_moe rollout drafts with method 'mtp' only")
            k = values.get("speculative_tokens") or mtp.num_speculative_tokens
            if k != mtp.num_speculative_tokens:
                raise ValueError(
                    f"{OPTIONS_KEY}.speculative_tokens={k} disagrees with "
                    f"{MTP_KEY}.num_speculative_tokens={mtp.num_speculative_tokens}: set one"
                )
            if k < 1:
                raise ValueError(f"{MTP_KEY}.num_speculative_tokens must be >= 1 with enable_rollout, got {k}")
            values["speculative_tokens"] = k
        return cls(**values)


def rollout_dtype(name: str) -> torch.dtype:
    """torch dtype of `rollout.dtype` ("bfloat16", "float32", ...). Raises ValueError naming the choices."""
    key = str(name).lower().removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"{ROLLOUT_KEY}.dtype={name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[key]


__all__ = ["DTYPES", "MTP_KEY", "OPTIONS_KEY", "ROLLOUT_KEY", "ROLLOUT_NAME", "RolloutOptions", "rollout_dtype"]
