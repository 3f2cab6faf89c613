"""What one `verl-moe align` run is asked to do (`AlignConfig`, checked when built) and the
default tolerances per precision class of a backend pair."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .backends import DTYPES, REPLAY_MODES, BackendSpec, parse_backend
from .data import PRESETS, StreamSpec
from .job import LOSS_MODES, TrainSettings
from .metrics import METRICS

ROUTER_ABLATION = ("bf16", "fp32", "fp64")

# Upper bounds (lower bound for grad_cosine_min) per precision class of a pair, for the tiny presets.
DEFAULT_TOLERANCES: dict[str, dict[str, float]] = {
    "fp64": {
        "logp_abs_diff_mean": 1e-9,
        "logp_abs_diff_max": 1e-7,
        "kl_k3_mean": 1e-12,
        "entropy_abs_diff_mean": 1e-9,
        "loss_abs_diff": 1e-9,
        "grad_norm_rel_diff": 1e-7,
        "grad_cosine_min": 1 - 1e-9,
        "router_flip_rate": 0.0,
        "param_drift": 1e-5,
    },
    "fp32": {
        "logp_abs_diff_mean": 2e-5,
        "logp_abs_diff_max": 5e-4,
        "kl_k3_mean": 1e-8,
        "entropy_abs_diff_mean": 2e-5,
        "loss_abs_diff": 2e-5,
        "grad_norm_rel_diff": 1e-3,
        "grad_cosine_min": 0.999,
        "router_flip_rate": 0.01,
        "param_drift": 0.05,
    },
    "bf16": {
        "logp_abs_diff_mean": 0.05,
        "logp_abs_diff_max": 1.0,
        "kl_k3_mean": 5e-3,
        "entropy_abs_diff_mean": 0.05,
        "loss_abs_diff": 0.02,
        "grad_norm_rel_diff": 0.1,
        "grad_cosine_min": 0.95,
        "router_flip_rate": 0.1,
        "param_drift": 0.5,
    },
}


@dataclass(frozen=True)
class AlignConfig:
    """One `verl-moe align` run.

    preset / model: a named preset (`data.PRESETS`) or a local HF folder (`model` wins; the
        preset then only shapes the batch stream). backends: backend names (see `backends/__init__.py`);
        the first that runs is the golden. steps: K optimizer steps. out: output folder.
    router_dtype: router dtype for every backend but the golden (None: each backend's default).
    router_ablation: run each non-golden backend with a bf16, fp32 and fp64 router.
    router_replay: "R2" | "R3" for every backend offering router replay whose name sets none (the
        golden included; megatron stays free), None: as the names say (`BackendSpec.replay`).
    tolerances: (metric, value) overrides of DEFAULT_TOLERANCES. loss: grpo | gspo. seed: weights + stream.
    batch_dump: a verl batch dump split into `steps` mini-batches instead of the generated stream
        (safetensors or a torch file of tensors; a pickled `DataProto` needs `trust_pickle`, since
        unpickling runs code stored in the file: `data.load_batch_dump`).
    stream: the generated stream's shape (None: the preset's). world_size: ranks of distributed
        backends without `world=` (None: the preset's). train: optimizer / schedule / loss knobs.
    old_logprob_noise: std of Gaussian noise added to the reference's θ0 log-probs to make
        `old_log_probs` (0: on-policy, ratio 1 at step 0).
    all_pairs: also compare every two non-golden backends (e.g. fsdp2 vs megatron at the same dtype).
    jobs: launched backends (all but the in-process reference) run this many at a time; on one
        accelerator they then share it, so their wall times overlap and are not comparable.
    """

    preset: str | None = "tiny-qwen3.5-moe"
    model: str | None = None
    backends: tuple[str, ...] = ("reference", "fsdp2")
    steps: int = 5
    out: str = "align_out"
    router_dtype: str | None = None
    router_ablation: bool = False
    router_replay: str | None = None
    tolerances: tuple[tuple[str, float], ...] = ()
    loss: str = "grpo"
    seed: int = 0
    batch_dump: str | None = None
    stream: StreamSpec | None = None
    world_size: int | None = None
    train: TrainSettings = field(default_factory=TrainSettings)
    old_logprob_noise: float = 0.0
    jobs: int = 1
    all_pairs: bool = False
    trust_pickle: bool = False
    progress: bool | None = None  # None: on when stdout is a terminal

    def __post_init__(self):
        if self.preset is None and self.model is None:
            raise ValueError("give --preset or --model")
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choices: {sorted(PRESETS)}")
        if not self.backends:
            raise ValueError("give at least one backend")
        for b in self.backends:
            parse_backend(b)
        if self.jobs < 1:
            raise ValueError(f"jobs must be >= 1, got {self.jobs}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.loss not in LOSS_MODES:
            raise ValueError(f"loss must be one of {list(LOSS_MODES)}, got {self.loss!r}")
        if self.router_dtype is not None and self.router_dtype not in DTYPES:
            raise ValueError(f"router_dtype must be one of {list(DTYPES)}, got {self.router_dtype!r}")
        if self.router_replay is not None and self.router_replay not in REPLAY_MODES:
            raise ValueError(f"router_replay must be one of {list(REPLAY_MODES)}, got {self.router_replay!r}")
        if self.router_dtype is not None and self.router_ablation:
            raise ValueError("router_dtype and router_ablation exclude each other")
        for metric, value in self.tolerances:
            if metric not in METRICS:
                raise ValueError(f"unknown tolerance metric {metric!r}; metrics: {list(METRICS)}")
            if not math.isfinite(value):  # a NaN bound is never exceeded: a gate that cannot fail
                raise ValueError(f"tolerance {metric}={value} must be a finite number")
        if self.train.loss != self.loss:
            object.__setattr__(self, "train", replace(self.train, loss=self.loss))
        labels = [s.label for s in expand_backends(self)]
        if len(labels) < 2:
            raise ValueError(
                f"nothing to compare: --backends {','.join(self.backends)} names one backend ({labels[0]}); "
                "give the golden and at least one more, e.g. reference,fsdp2"
            )


def expand_backends(cfg: AlignConfig) -> list[BackendSpec]:
    """The backend list after --router-replay / --router-dtype / --router-ablation (the first backend, the
    golden, is kept)."""
    specs = [parse_backend(b) for b in cfg.backends]
    if cfg.router_replay:
        specs = [
            replace(s, replay=cfg.router_replay) if s.replay is None and "replay" in s.backend.options else s
            for s in specs
        ]
    golden, others = specs[0], specs[1:]
    if cfg.router_dtype:
        others = [s if s.router else replace(s, router=cfg.router_dtype) for s in others]
    if cfg.router_ablation:
        others = [replace(s, router=r) for s in (others or [golden]) for r in ROUTER_ABLATION]
    seen, out = set(), []
    for s in [golden, *others]:
        if s.label not in seen:
            seen.add(s.label)
            out.append(s)
    return out


def tolerances_for(cls: str, cfg: AlignConfig) -> dict[str, float]:
    return {**DEFAULT_TOLERANCES[cls], **dict(cfg.tolerances)}
