"""`verl-moe align`: the same HF weights and the same RL batches through several backends.

Per backend pair (the golden, normally the fp64 `reference`, against each other backend) the
report holds the one-step metrics (step 0: same weights, same batch), the per-step curves over K
optimizer steps (GRPO or GSPO through verl's `ppo_loss`, same AdamW and LR schedule), and the
first step where each metric leaves its tolerance. Metric definitions: `metrics.METRICS`.

Tolerances: `config.DEFAULT_TOLERANCES[cls]`, where cls is the lower-precision parameter dtype of the
pair (fp64, fp32 or bf16); `--tol metric=value` overrides a metric for every pair. The run exits
non-zero when any pair leaves a tolerance at any step or a backend fails; skipped backends
(cannot run here) are listed with the reason and do not fail the run.

Outputs under `out`: report.json (schema `report.REPORT_SCHEMA`), curves.png (K-step curves),
logp_hist.png (per-token |Δ log-prob| at step 0), the model folder, the batch stream, and one
trace + log per backend.

report.json (schema 1; `REPORT_SCHEMA` is the JSON Schema, `validate_report` checks it):
    schema, tool ("align"), argv, device, device_name, versions, git_sha  (tools/provenance.environment)
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
from pathlib import Path

import torch

from .backends import BackendSpec, unavailable
from .backends.reference import fill_old_log_probs
from .config import ROUTER_ABLATION, AlignConfig, expand_backends, tolerances_for
from .data import (
    StreamSpec,
    VisionTokens,
    create_model_dir,
    get_preset,
    hf_config,
    label_slug,
    load_batch_dump,
    make_stream,
    model_dir_for,
    text_vocab_size,
)
from .job import Job
from .launch import run_backend
from .metrics import compare
from .report import PRECISIONS, SCHEMA_VERSION, json_safe, plot_curves, plot_logp_hist
from .trace import BackendTrace


def precision_class(a: BackendTrace, b: BackendTrace) -> str:
    return min(a.settings["dtype"], b.settings["dtype"], key=PRECISIONS.index)


def check_inputs(cfg: AlignConfig, specs: list[BackendSpec]) -> tuple[dict[str, str], list | None]:
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

            vocab = text_vocab_size(AutoConfig.from_pretrained(cfg.model))
        else:
            vocab = text_vocab_size(hf_config(get_preset(cfg.preset)))
        top = max(int(b["input_ids"].max()) for b in dump)
        if top >= vocab:
            raise ValueError(f"batch dump {cfg.batch_dump}: token id {top} >= the model's vocab_size {vocab}")
    skipped = {s.label: reason for s in specs if (reason := unavailable(s))}
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
        stream = make_stream(spec, text_vocab_size(hf), cfg.steps, cfg.seed, VisionTokens.of(hf))
        source = f"generated (seed {cfg.seed})"
    r3 = any(s.replay == "R3" for s in expand_backends(cfg))  # the fp64 θ0 routes ride in the stream
    fill_old_log_probs(model_dir, stream, cfg.train.temperature, routes=r3)
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
    from ..provenance import environment

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
            world = (spec.world or default_world) if spec.backend.launched else 1
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
            job = Job(
                backend=spec.label,
                model_dir=str(model_dir_for(spec, model_dir, out / "models")),
                stream_path=str(stream_path),
                trace_path=str(out / "traces" / f"{label_slug(spec.label)}.pt"),
                train=cfg.train,
                world_size=world,
            )
            Path(job.trace_path).parent.mkdir(parents=True, exist_ok=True)
            (launched if spec.backend.launched else in_process).append((row, job))

        def run_one(row: dict, job: Job) -> None:
            task = progress.add_task(row["label"], total=cfg.steps)
            start = time.perf_counter()
            try:
                trace = run_backend(job, out / "logs", lambda k: progress.update(task, completed=k))
            except Exception as e:  # reported, and the run fails; other backends still run
                row.update(status="failed", reason=f"{type(e).__name__}: {e}")
                return
            finally:
                row["wall_s"] = time.perf_counter() - start
            traces[row["label"]] = trace
            row["loss"] = [s.loss for s in trace.steps]
            row["grad_norm"] = [s.grad_norm for s in trace.steps]

        # the in-process backend (the reference) first: it frees the accelerator memory before workers start
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
