"""`OpsConfig`: which implementation of each op a model uses, decided once at build time."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch

ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}
# `_target_` values a Hydra mapping of this config may carry (configs/engine/*.yaml name the first)
_TARGETS = ("verl_moe.models.OpsConfig", "verl_moe.models.ops_config.OpsConfig")
# Exact mode's implementation of every op a model resolves (training, decoding, sampling, log-prob head).
EXACT_IMPLS = {
    "linear": "exact",
    "norm": "exact",
    "rope": "torch",
    "attention": "exact",
    "attention.decode": "exact",
    "attention.cached": "exact",
    "gdn": "exact",
    "gdn.step": "exact",
    "gdn.positions": "exact",
    "conv1d": "exact",
    "conv1d.step": "exact",
    "conv1d.positions": "exact",
    "router": "exact",
    "experts": "exact",
    "logprob": "exact",
    "sampling": "exact",
}


@dataclass(frozen=True)
class OpsConfig:
    """Implementation per op, and the router's compute dtype.

    Attributes:
        gdn, norm, rope, conv1d, attention, router, experts, logprob: an implementation name from the op's
            `IMPLS` (e.g. "torch", "triton", "fla"), or "auto" for `verl_moe.ops.resolve`'s default
            (VERL_MOE_OPS, else triton on cuda/npu when the op has a kernel, else torch). "exact" gives the
            op's exact form in the trainer and in the rollout's decode step alike (gdn="exact": fast mode
            with exact mode's gated delta rule, the op that carries most of fast mode's mismatch).
        router_dtype: "fp32" (default), "fp64", "bf16" (for ablations), or "model". transformers computes the router
            GEMM in the model dtype (bf16 in training) and only the softmax in fp32; "fp32"
            computes the GEMM, softmax, top-k and combine weights in fp32, "model" keeps every
            step in the model dtype.
    """

    gdn: str = "auto"
    norm: str = "auto"
    rope: str = "auto"
    conv1d: str = "auto"
    attention: str = "auto"
    router: str = "auto"
    experts: str = "auto"
    logprob: str = "auto"
    router_dtype: str = "fp32"
    exact: bool = False

    def __post_init__(self):
        if not isinstance(self.exact, bool):
            raise ValueError(f"OpsConfig.exact must be true or false, got {self.exact!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "exact":
                continue
            if not isinstance(value, str) or not value:
                raise ValueError(f"OpsConfig.{f.name} must be a non-empty string, got {value!r}")
            if self.exact and f.name != "router_dtype" and value != "auto":
                raise ValueError(
                    f"OpsConfig.exact picks every op's implementation: leave {f.name} at auto, got {value!r}"
                )
        if self.router_dtype not in (*ROUTER_DTYPES, "model"):
            choices = ", ".join([*ROUTER_DTYPES, "model"])
            raise ValueError(f"OpsConfig.router_dtype must be one of {choices}; got {self.router_dtype!r}")

    @classmethod
    def coerce(cls, value: OpsConfig | Mapping | None) -> OpsConfig:
        """`value` as an OpsConfig: itself, the defaults for None, or the fields of a mapping (a dict,
        or the DictConfig a Hydra config gives, whose `_target_` may name this class).

        Raises:
            ValueError: a mapping key that is no field (the valid ones are listed), another `_target_`,
                or a bad field value.
            TypeError: anything else.
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"ops must be an OpsConfig or a mapping of its fields, got {type(value).__name__}")
        values = dict(value)
        target = values.pop("_target_", _TARGETS[0])
        if target not in _TARGETS:
            raise ValueError(f"ops: _target_ {target!r} is not {_TARGETS[0]}")
        valid = [f.name for f in fields(cls)]
        unknown = sorted(map(str, set(values) - set(valid)))
        if unknown:
            raise ValueError(f"ops: unknown key(s) {unknown}; valid: {valid}")
        return cls(**values)

    def impl(self, op: str) -> str | None:
        """The implementation name to pass to `verl_moe.ops.resolve` for `op` (None for "auto"): exact
        mode's (`EXACT_IMPLS`) when exact, else the field's for an op with a field; a decoding op
        ("gdn.step", "attention.decode", ...) takes "exact" where its op's field is "exact" (the pair that
        computes the same numbers in the trainer and the rollout), else None."""
        if self.exact:
            return EXACT_IMPLS[op]
        if "." in op:
            return "exact" if getattr(self, op.split(".")[0], "auto") == "exact" else None
        value = getattr(self, op, "auto")
        return None if value == "auto" else value

    def router_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype if self.router_dtype == "model" else ROUTER_DTYPES[self.router_dtype]
