"""`verl-moe align`: the same HF weights and the same RL batches through several backends.

Per backend pair (the golden, normally the fp64 `reference`, against each other backend) the
report holds the one-step metrics (step 0: same weights, same batch), the per-step curves over K
optimizer steps (GRPO or GSPO through verl's `ppo_loss`, same AdamW and LR schedule), and the
first step where each metric leaves its tolerance. Metric definitions: `align_metrics.METRICS`.

Tolerances: `DEFAULT_TOLERANCES[cls]`, where cls is the lower-precision parameter dtype of the
pair (fp64, fp32 or bf16); `--tol metric=value` overrides a metric for every pair. The run exits
non-zero when any pair leaves a tolerance at any step or a backend fails; skipped backends
(cannot run here) are listed with the reason and do not fail the run.

Outputs under `out`: report.json (schema `REPORT_SCHEMA`), curves.png (K-step curves),
logp_hist.png (per-token |Δ log-prob| at step 0), the model folder, the batch stream, and one
trace + log per backend.

report.json (schema 1; `REPORT_SCHEMA` is the JSON Schema, `validate_report` checks it):
    schema, tool ("align"), argv, device, device_name, versions, git_sha  (tools/report.environment)
    config      the AlignConfig as a dict
    model       {path, preset, model_type, num_parameters}
    stream      {source, steps, sequences[k], tokens[k], response_tokens[k]}
    golden      label of the backend every other one is compared with
    backends[]  {label, name, status ok|skipped|failed, reason, dtype, router_dtype, world_size,
                 wall_s, loss[k], grad_norm[k]}
    pairs[]     golden vs each backend, then (all_pairs) every two others:
                {a, b, precision fp64|fp32|bf16, one_step {metric: value, grad_cosine {group: cos}},
                 curves[k] (same rows per step), tolerances {metric: bound}, first_exceeded
                 {metric: step|null}, first_divergence_step, exceeded_at_step0 [metric], ok}
    router_ablation  {router_dtypes} or null;  plots {curves, logp_hist}: PNG paths
    ok, exit_code    0 when every pair stays within tolerance and no backend failed, else 1
Non-finite numbers are written as null.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from . import align_backends as ab
from .align_metrics import METRICS, BackendTrace, compare
from .align_report import (
    PRECISIONS,
    REPORT_SCHEMA,
    SCHEMA_VERSION,
    json_safe,
    plot_curves,
    plot_logp_hist,
    print_report,
    validate_report,
)
from .presets import PRESETS, StreamSpec, create_model_dir, get_preset, load_batch_dump, make_stream

__all__ = [
    "DEFAULT_TOLERANCES",
    "REPORT_SCHEMA",
    "SCHEMA_VERSION",
    "AlignConfig",
    "expand_backends",
    "print_report",
    "run",
    "validate_report",
]
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

    preset / model: a named preset (`presets.PRESETS`) or a local HF folder (`model` wins; the
        preset then only shapes the batch stream). backends: backend names (see align_backends);
        the first that runs is the golden. steps: K optimizer steps. out: output folder.
    router_dtype: router dtype for every backend but the golden (None: each backend's default).
    router_ablation: run each non-golden backend with a bf16, fp32 and fp64 router.
    tolerances: (metric, value) overrides of DEFAULT_TOLERANCES. loss: grpo | gspo. seed: weights + stream.
    batch_dump: a verl batch dump split into `steps` mini-batches instead of the generated stream
        (safetensors or a torch file of tensors; a pickled `DataProto` needs `trust_pickle`, since
        unpickling runs code stored in the file: `presets.load_batch_dump`).
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
    tolerances: tuple[tuple[str, float], ...] = ()
    loss: str = "grpo"
    seed: int = 0
    batch_dump: str | None = None
    stream: StreamSpec | None = None
    world_size: int | None = None
    train: ab.TrainSettings = field(default_factory=ab.TrainSettings)
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
            ab.parse_backend(b)
        if self.jobs < 1:
            raise ValueError(f"jobs must be >= 1, got {self.jobs}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.loss not in ab.LOSS_MODES:
            raise ValueError(f"loss must be one of {list(ab.LOSS_MODES)}, got {self.loss!r}")
        if self.router_dtype is not None and self.router_dtype not in ab.DTYPES:
            raise ValueError(f"router_dtype must be one of {list(ab.DTYPES)}, got {self.router_dtype!r}")
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


# ---- run ---------------------------------------------------------------------------------------


def expand_backends(cfg: AlignConfig) -> list[ab.BackendSpec]:
    """The backend list after --router-dtype / --router-ablation (the first backend, the golden, is kept)."""
    specs = [ab.parse_backend(b) for b in cfg.backends]
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


def precision_class(a: BackendTrace, b: BackendTrace) -> str:
    return min(a.settings["dtype"], b.settings["dtype"], key=PRECISIONS.index)


def tolerances_for(cls: str, cfg: AlignConfig) -> dict[str, float]:
    return {**DEFAULT_TOLERANCES[cls], **dict(cfg.tolerances)}


def check_inputs(cfg: AlignConfig, specs: list[ab.BackendSpec]) -> tuple[dict[str, str], list | None]:
    """What `run` checks before it writes or starts anything: the model folder, the batch dump
    (loaded here, so a refused pickle, a bad split or a token id past the vocabulary fails now),
    and that at least two backends can run on this machine (with fewer, no pair is compared and
    the gate could not fail).

    Returns the skip reason of each backend that cannot run here, and the loaded dump (or None).
    Raises FileNotFoundError / ValueError naming the input."""
    if cfg.model:
        model = Path(cfg.model)
        if not model.is_dir():
            raise FileNotFoundError(f"--model {model}: no such folder")
        if not (model / "config.json").is_file():
            raise FileNotFoundError(f"--model {model}: no config.json (not a Hugging Face model folder)")
    dump = load_batch_dump(cfg.batch_dump, cfg.steps, cfg.trust_pickle) if cfg.batch_dump else None
    if dump is not None:
        if cfg.model:
            from transformers import AutoConfig

            vocab = AutoConfig.from_pretrained(cfg.model).vocab_size
        else:
            vocab = get_preset(cfg.preset).config["vocab_size"]
        top = max(int(b["input_ids"].max()) for b in dump)
        if top >= vocab:
            raise ValueError(f"batch dump {cfg.batch_dump}: token id {top} >= the model's vocab_size {vocab}")
    skipped = {s.label: reason for s in specs if (reason := ab.unavailable(s))}
    runnable = [s.label for s in specs if s.label not in skipped]
    if len(runnable) < 2:
        why = "; ".join(f"{label} skipped: {reason}" for label, reason in skipped.items())
        raise ValueError(f"nothing to compare: only {runnable or 'no backend'} can run here ({why})")
    return skipped, dump


def _prepare(cfg: AlignConfig, out: Path, dump: list | None) -> tuple[Path, list[dict], dict, dict]:
    preset = get_preset(cfg.preset) if cfg.preset else None
    if cfg.model:
        model_dir = Path(cfg.model)
    else:
        model_dir = create_model_dir(preset, cfg.seed, out / "model")
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(model_dir))
    if dump is not None:
        stream, source = dump, str(cfg.batch_dump)
    else:
        spec = cfg.stream or (preset.stream if preset else StreamSpec())
        stream, source = make_stream(spec, hf.vocab_size, cfg.steps, cfg.seed), f"generated (seed {cfg.seed})"
    ab.fill_old_log_probs(model_dir, stream, cfg.train.temperature)
    if cfg.old_logprob_noise > 0:
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        for batch in stream:
            noise = torch.randn(batch["old_log_probs"].shape, generator=gen) * cfg.old_logprob_noise
            batch["old_log_probs"] = batch["old_log_probs"] + noise * batch["response_mask"]
    from safetensors import safe_open

    num_params = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            num_params += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    model_info = {
        "path": str(model_dir),
        "preset": cfg.preset if not cfg.model else None,
        "model_type": hf.model_type,
        "num_parameters": num_params,
    }
    stream_info = {
        "source": source,
        "steps": len(stream),
        "sequences": [int(b["input_ids"].shape[0]) for b in stream],
        "tokens": [int(b["attention_mask"].sum()) for b in stream],
        "response_tokens": [int(b["response_mask"].sum()) for b in stream],
    }
    return model_dir, stream, model_info, stream_info


def run(cfg: AlignConfig) -> dict:
    """Run every backend, compare each with the golden, write report.json and the plots."""
    from .report import environment

    specs = expand_backends(cfg)
    skipped, dump = check_inputs(cfg, specs)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir, stream, model_info, stream_info = _prepare(cfg, out, dump)
    stream_path = out / "stream.pt"
    torch.save(stream, stream_path)
    preset = get_preset(cfg.preset) if cfg.preset else None
    default_world = cfg.world_size or (preset.world_size if preset else 2)

    traces: dict[str, BackendTrace] = {}
    rows = []
    with _progress(cfg) as progress:
        in_process, launched = [], []
        for spec in specs:
            world = 1 if spec.name == "reference" else (spec.world or default_world)
            row = {
                "label": spec.label,
                "name": spec.name,
                "status": "ok",
                "reason": None,
                "dtype": spec.compute_dtype,
                "router_dtype": spec.router_dtype,
                "world_size": world,
                "wall_s": None,
                "loss": [],
                "grad_norm": [],
            }
            rows.append(row)
            reason = skipped.get(spec.label)
            if reason:
                row.update(status="skipped", reason=reason)
                continue
            job = ab.Job(
                backend=spec.label,
                model_dir=str(ab.model_dir_for(spec, model_dir, out / "models")),
                stream_path=str(stream_path),
                trace_path=str(out / "traces" / f"{_slug(spec.label)}.pt"),
                train=cfg.train,
                world_size=world,
            )
            Path(job.trace_path).parent.mkdir(parents=True, exist_ok=True)
            (in_process if spec.name == "reference" else launched).append((row, job))

        def run_one(row: dict, job: ab.Job) -> None:
            task = progress.add_task(row["label"], total=cfg.steps)
            start = time.perf_counter()
            try:
                trace = ab.run_backend(job, out / "logs", lambda k: progress.update(task, completed=k))
            except Exception as e:  # reported, and the run fails; other backends still run
                row.update(status="failed", reason=f"{type(e).__name__}: {e}")
                return
            finally:
                row["wall_s"] = time.perf_counter() - start
            traces[row["label"]] = trace
            row["loss"] = [s.loss for s in trace.steps]
            row["grad_norm"] = [s.grad_norm for s in trace.steps]

        # the in-process reference first: it frees the accelerator memory before workers start
        for row, job in in_process:
            run_one(row, job)
        with ThreadPoolExecutor(max_workers=cfg.jobs) as pool:
            for f in [pool.submit(run_one, row, job) for row, job in launched]:
                f.result()

    ok_labels = [s.label for s in specs if s.label in traces]
    golden = ok_labels[0] if ok_labels else None
    pairs = []
    compared = [(golden, label) for label in ok_labels[1:]]
    if cfg.all_pairs:
        compared += list(itertools.combinations(ok_labels[1:], 2))
    for label_a, label_b in compared:
        a, b = traces[label_a], traces[label_b]
        cls = precision_class(a, b)
        pair = compare(a, b, tolerances_for(cls, cfg))
        pair["precision"] = cls
        pair["ok"] = pair["first_divergence_step"] is None
        pairs.append(pair)

    plots = {}
    if pairs:
        plots["curves"] = str(plot_curves(pairs, out / "curves.png"))
        vs_golden = [p["b"] for p in pairs if p["a"] == golden]
        plots["logp_hist"] = str(plot_logp_hist(traces, golden, vs_golden, out / "logp_hist.png"))
    failed = any(r["status"] == "failed" for r in rows)
    # no pair (every backend but one failed) is never ALIGNED: a gate must be able to fail
    ok = not failed and bool(pairs) and all(p["ok"] for p in pairs) and golden is not None
    report = {
        "schema": SCHEMA_VERSION,
        "tool": "align",
        "argv": list(sys.argv),
        **environment(),
        "config": _config_dict(cfg),
        "model": model_info,
        "stream": stream_info,
        "golden": golden,
        "backends": rows,
        "pairs": pairs,
        "router_ablation": {"router_dtypes": list(ROUTER_ABLATION)} if cfg.router_ablation else None,
        "plots": plots,
        "ok": ok,
        "exit_code": 0 if ok else 1,
    }
    report = json_safe(report)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


def _slug(label: str) -> str:
    return label.replace(":", "_").replace("=", "-").replace("/", "_")


def _config_dict(cfg: AlignConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["tolerances"] = dict(cfg.tolerances)
    return d


class _NoProgress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add_task(self, *a, **k):
        return 0

    def update(self, *a, **k):
        pass


def _progress(cfg: AlignConfig):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    show = cfg.progress if cfg.progress is not None else Console().is_terminal
    if not show:
        return _NoProgress()
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())


def main() -> None:
    """`python -m verl_moe.tools.align ...`: the same options as `verl-moe align`."""
    from .cli import app

    app(args=["align", *sys.argv[1:]], prog_name="python -m verl_moe.tools.align")


if __name__ == "__main__":
    main()
