"""`verl-moe bench <op>`: every provider of one op in one process, as ratios. This package holds every
benchmark: this runner, one module per op (`ops/`), the model step (`model.py`), our kernels in the anchors'
models (`veomni.py`, `transformers.py`, sharing `integrations.py`), the rollout (`rollout.py`), exact mode
against fast mode (`exact.py`), and the GDN kernel profile (`gdn_profile.py`).

Each bench module the runner takes (`ops/<op>.py`, BENCH_MODULES) declares CASES, PROVIDERS, REFERENCE,
MODES, TOLERANCE and the functions `unavailable`, `make_inputs`, `run` (docs/benchmarking.md); optionally
OPTIONS (the keys `BenchConfig.extra` may set on every case, e.g. the model step's `offload`) and, per case,
`providers` (the only ones that run it). Per case and mode:
untimed warm-up (compile, autotune), a correctness check of every provider against REFERENCE,
then the median time and the peak memory above the inputs.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...ops import device
from ...ops.compare import rel_rms
from ..provenance import environment
from ..table import render_table
from .timing import kernel_ms, time_ms


@dataclass(frozen=True)
class BenchConfig:
    op: str
    cases: tuple[str, ...] = ()  # case ids to run; empty = all
    providers: tuple[str, ...] = ()  # empty = all the module declares
    modes: tuple[str, ...] = ()  # empty = the module's MODES
    warmup: int = 2
    reps: int = 10
    json_path: str | None = None
    extra: dict = field(default_factory=dict)  # options set on every case (the module's OPTIONS)

    def __post_init__(self):
        ops = bench_ops()
        if self.op not in ops:
            raise ValueError(f"unknown bench op {self.op!r}; choices: {ops}")
        if self.warmup < 1 or self.reps < 1:  # the warm-up call also gives the outputs checked
            raise ValueError(f"warmup and reps must be >= 1, got warmup={self.warmup}, reps={self.reps}")
        if self.json_path and not Path(self.json_path).resolve().parent.is_dir():
            raise FileNotFoundError(f"--json {self.json_path}: folder {Path(self.json_path).parent} does not exist")


# names that are not ops -> their bench module: the training step, and our kernels inside the anchors'
# own models (VeOmni's kernel slots, transformers' patched model)
BENCH_MODULES = {
    "model": "verl_moe.tools.bench.model",
    "veomni": "verl_moe.tools.bench.veomni",
    "transformers": "verl_moe.tools.bench.transformers",
}
OPS_FOLDER = Path(__file__).parent / "ops"  # one module per op, named as the op's folder of verl_moe.ops


def bench_ops() -> list[str]:
    """What `verl-moe bench` takes: each op with a module in tools/bench/ops, and BENCH_MODULES."""
    return [*sorted(p.stem for p in OPS_FOLDER.glob("*.py") if p.stem != "__init__"), *BENCH_MODULES]


def _peak_extra_gib(fn) -> float:
    """Peak memory allocated during one call, above what was allocated before it (accelerators only)."""
    if not device.is_accelerator():
        return float("nan")
    device.synchronize()
    device.empty_cache()
    before = device.device_module().memory_allocated()
    device.reset_peak_memory_stats()
    fn()
    device.synchronize()
    return (device.max_memory_allocated() - before) / 1024**3


def _errors(ref_out: list, out: list) -> list[float]:
    """Relative RMS error of each output against the reference's (NaN where either is missing)."""
    return [float("nan") if r is None or o is None else rel_rms(r, o) for r, o in zip(ref_out, out)]


def _asked_gib(message: str) -> float:
    """The allocation an out-of-memory error names ("Tried to allocate 15.00 GiB"), in GiB; NaN if none."""
    match = re.search(r"[Tt]ried to allocate ([0-9.]+) ([KMGT]i?B)", message)
    if not match:
        return float("nan")
    scale = {"K": 2**-20, "M": 2**-10, "G": 1.0, "T": 2**10}[match.group(2)[0]]
    return float(match.group(1)) * scale


def _failed_row(case: dict, mode: str, provider: str, exc: BaseException, extra: dict) -> dict:
    """The row of a provider that could not run the case: out of memory (with the allocation it asked
    for; not a failed check) or another error (a failed check)."""
    # torch_npu raises a RuntimeError saying "out of memory" where cuda raises torch.OutOfMemoryError
    oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()
    message = " ".join(str(exc).split())
    return {
        "case": case["id"],
        "mode": mode,
        "provider": provider,
        "ms": float("nan"),
        "kernel_ms": float("nan"),
        "peak_extra_gib": float("nan"),
        "rel_rms_vs_ref": float("nan"),
        "rel_rms_per_output": [],
        "check_ok": oom,
        "error": f"{type(exc).__name__}: {message[:300]}",
        **({"asked_gib": _asked_gib(message)} if oom else {}),
        **extra,
    }


def run(
    cfg: BenchConfig,
    on_row: Callable[[dict], None] | None = None,
    on_start: Callable[[str, str, str], None] | None = None,
) -> dict:
    """Run the benchmark of `cfg.op`; returns the report dict, also written to cfg.json_path after
    every (case, mode), so a run cut short keeps what it measured. `on_row` sees each row as soon
    as it is measured (its ratio columns come with the report), `on_start` each (case, mode, provider)
    as it starts. A provider that runs out of memory or fails on a case becomes a row with its `error`
    (and, out of memory, the `asked_gib` it asked for), and the run goes on; `busy_share` is the
    kernels' share of the wall time where both are measured."""
    module = BENCH_MODULES.get(cfg.op, f"verl_moe.tools.bench.ops.{cfg.op}")
    bench = importlib.import_module(module)
    dev = device.current_device()
    providers = cfg.providers or tuple(bench.PROVIDERS)
    unknown = set(providers) - set(bench.PROVIDERS)
    if unknown:
        raise ValueError(f"unknown providers {sorted(unknown)} for op {cfg.op}; choices: {list(bench.PROVIDERS)}")
    case_ids = [c["id"] for c in bench.CASES]
    unknown = set(cfg.cases) - set(case_ids)
    if unknown:
        raise ValueError(f"unknown cases {sorted(unknown)} for op {cfg.op}; cases: {case_ids}")
    cases = [c for c in bench.CASES if not cfg.cases or c["id"] in cfg.cases]
    unknown = set(cfg.modes) - set(bench.MODES)
    if unknown:
        raise ValueError(f"unknown modes {sorted(unknown)} for op {cfg.op}; modes: {list(bench.MODES)}")
    unknown = set(cfg.extra) - set(getattr(bench, "OPTIONS", ()))
    if unknown:
        raise ValueError(
            f"unknown options {sorted(unknown)} for op {cfg.op}; options: {list(getattr(bench, 'OPTIONS', ()))}"
        )
    rows, skipped = [], {}
    for p in providers:
        reason = bench.unavailable(p)
        if reason:
            skipped[p] = reason
    report = {
        "schema": 1,
        "tool": "bench",
        "op": cfg.op,
        "argv": sys.argv,
        **environment(),
        "skipped_providers": skipped,
        "rows": rows,
    }
    active = [p for p in providers if p not in skipped]
    for case in cases if active else []:
        case_active = [p for p in active if p in case.get("providers", active)]
        for mode in cfg.modes or bench.MODES:
            failed: dict[str, BaseException] = {}
            inputs = ref_out = call = out = None
            try:
                inputs = bench.make_inputs({**case, **cfg.extra}, dev)
            except Exception as exc:  # the case itself does not fit: every provider's row says so
                failed = dict.fromkeys(case_active, exc)
            # The check needs the reference selected (and runnable); deselecting it times only.
            if not failed and case.get("check", True) and bench.REFERENCE in case_active:
                try:
                    ref_out = [t.detach() if t is not None else None for t in bench.run(bench.REFERENCE, inputs, mode)]
                except Exception as exc:
                    failed[bench.REFERENCE] = exc
            timings = {}
            for p in case_active:
                if on_start:
                    on_start(case["id"], mode, p)
                if p not in failed:
                    try:
                        call = functools.partial(bench.run, p, inputs, mode)
                        for _ in range(cfg.warmup):
                            out = call()
                        # A case may name providers whose output is not comparable there (transformers ignores
                        # packing).
                        checked = ref_out is not None and p not in case.get("unchecked", ())
                        errors = _errors(ref_out, out) if checked else []
                        out = None
                        measured = [e for e in errors if e == e]
                        err = max(measured) if measured else float("nan")
                        ok = err != err or err <= bench.TOLERANCE.get(p, 0.0)
                        ms = time_ms(call, cfg.reps)
                        kms = kernel_ms(call, min(cfg.reps, 3))
                        mem = _peak_extra_gib(call)
                    except Exception as exc:
                        failed[p] = exc
                if p in failed:
                    rows.append(_failed_row(case, mode, p, failed.pop(p), cfg.extra))
                    out = call = None
                    device.empty_cache()  # the failed provider's tensors went with its frames
                    if on_row:
                        on_row(rows[-1])
                    continue
                timings[p] = (ms, kms)
                rows.append(
                    {
                        "case": case["id"],
                        "mode": mode,
                        "provider": p,
                        "ms": ms,
                        "kernel_ms": kms,
                        "busy_share": kms / ms,
                        "peak_extra_gib": mem,
                        "rel_rms_vs_ref": err,
                        "rel_rms_per_output": errors,
                        "check_ok": ok,
                        **cfg.extra,
                    }
                )
                if hasattr(bench, "derived"):  # e.g. the model step's tokens/s, MFU and own peak memory
                    rows[-1].update(bench.derived(case, p, mode, inputs, ms, mem))
                if on_row:
                    on_row(rows[-1])
            ours = active[0] if active else None
            for row in rows:
                if row["case"] == case["id"] and row["mode"] == mode and ours in timings and "error" not in row:
                    row[f"ratio_{ours}_over_this"] = timings[ours][0] / row["ms"]
                    if row["kernel_ms"] == row["kernel_ms"]:  # measured (cuda)
                        row[f"kernel_ratio_{ours}_over_this"] = timings[ours][1] / row["kernel_ms"]
            # drop every reference to this case's tensors (the last partial holds the inputs, and
            # through them a model bench's models) before the next case allocates its own
            inputs = ref_out = call = None
            device.empty_cache()
            write_report(report, cfg.json_path)
    write_report(report, cfg.json_path)
    return report


def write_report(report: dict, path: str | None) -> None:
    """Write `report` as JSON to `path` (None: nothing) through a temporary file and a rename, so a run
    killed or failing while it writes leaves the previous whole report."""
    if not path:
        return
    part = f"{path}.part"
    try:
        with open(part, "w") as f:
            json.dump(report, f, indent=2)
        os.replace(part, path)
    finally:
        if os.path.exists(part):
            os.remove(part)


BASE_COLUMNS = (
    *("case", "mode", "provider", "ms", "kernel_ms"),
    *("peak_extra_gib", "rel_rms_vs_ref", "rel_rms_per_output", "check_ok"),
)
RATIO_PREFIXES = ("ratio_", "kernel_ratio_")


def _extra_columns(row: dict) -> list[str]:
    """Columns a bench module's `derived` adds (model: tokens_per_s, mfu, peak_gib), then the ratios."""
    extra = [k for k in row if k not in BASE_COLUMNS and not k.startswith(RATIO_PREFIXES)]
    return extra + [k for k in row if k.startswith(RATIO_PREFIXES)]


def _cell(value) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) else str(value)


def print_row(row: dict) -> None:
    """One progress line per measured row (the table follows at the end)."""
    if "error" in row:
        gib = row.get("asked_gib", float("nan"))
        asked = f" (asked for {gib:.2f} GiB)" if gib == gib else ""  # NaN: the message named no allocation
        print(f"{row['case']} {row['mode']} {row['provider']}: not run: {row['error']}{asked}", flush=True)
        return
    derived = "".join(f", {k} {_cell(row[k])}" for k in _extra_columns(row) if not k.startswith(RATIO_PREFIXES))
    kernel = f" (kernels {row['kernel_ms']:.3f} ms)" if row["kernel_ms"] == row["kernel_ms"] else ""
    print(
        f"{row['case']} {row['mode']} {row['provider']}: {row['ms']:.3f} ms{kernel}, "
        f"peak +{row['peak_extra_gib']:.2f} GiB, "
        f"rel-RMS {row['rel_rms_vs_ref']:.2e}{derived}{'' if row['check_ok'] else '  CHECK FAILED'}",
        flush=True,
    )


def print_report(report: dict) -> None:
    columns = ["case", "mode", "provider", "ms", "kernel_ms", "peak_extra_gib", "rel_rms_vs_ref", "check_ok"]
    extra = list(dict.fromkeys(k for row in report["rows"] for k in _extra_columns(row)))
    render_table(f"verl-moe bench {report['op']} on {report['device_name']}", columns + extra, report["rows"])
    for p, why in report["skipped_providers"].items():
        print(f"skipped provider {p}: {why}")
