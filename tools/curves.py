"""`verl-moe curves`: metrics of several verl runs side by side per step, divergence marked.

Reads verl's file-logger JSONL (`{"step": s, "data": {key: value}}` per line, written by
`trainer.logger=[file]`) and TensorBoard event files (`trainer.logger=[tensorboard]`), from a
file or a folder each. A metric is an exact logged key or an alias (`ALIASES`: reward,
accuracy, grad_norm, entropy, kl) resolved against each run's keys.

Divergence: the first run is the baseline. Both series are smoothed by a trailing mean of
`smooth` steps; a run diverges at the first common step s where the smoothed gap exceeds
`rtol * scale` (scale = max |baseline| over the common steps) at s and at the following
`patience - 1` common steps.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ALIASES: dict[str, tuple[str, ...]] = {
    "reward": (r"critic/score/mean", r"critic/rewards/mean", r"reward"),
    "accuracy": (r"val-core/.*/acc/mean@\d+", r"val-core/.*/acc.*", r".*acc(uracy)?(/mean)?"),
    "grad_norm": (r"actor/grad_norm", r".*grad_norm"),
    "entropy": (r"actor/entropy", r".*entropy(/mean)?"),
    "kl": (r"actor/ppo_kl", r"actor/kl_loss", r".*kl(_loss)?"),
}
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class CurvesConfig:
    """runs: paths (a .jsonl file or a folder with a .jsonl or TensorBoard event files), each
    optionally `label=path`. metrics: aliases or exact keys. out: folder for curves.png / curves.json."""

    runs: tuple[str, ...]
    metrics: tuple[str, ...] = ("reward", "accuracy", "grad_norm", "entropy", "kl")
    out: str = "curves_out"
    rtol: float = 0.1
    smooth: int = 5
    patience: int = 3

    def __post_init__(self):
        if not self.runs:
            raise ValueError("curves needs at least one run")
        if self.smooth < 1 or self.patience < 1 or self.rtol <= 0:
            raise ValueError("smooth and patience must be >= 1 and rtol > 0")


Series = dict[str, dict[int, float]]  # key -> {step: value}


def read_jsonl(path: Path) -> Series:
    """verl's file-logger lines; ValueError naming the file and line for one that is not
    `{"step": int, "data": {...}}` (a run killed mid-write leaves a truncated last line)."""
    series: Series = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
                step, data = int(row["step"]), row.get("data", {})
                if not isinstance(data, dict):
                    raise TypeError("data is not an object")
            except (ValueError, KeyError, TypeError) as e:
                why = e.msg if isinstance(e, json.JSONDecodeError) else f"{type(e).__name__}: {e}"
                raise ValueError(f"{path}:{lineno}: not a verl JSONL line ({why})") from None
            for key, value in data.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    series.setdefault(key, {})[step] = float(value)
    return series


def read_tensorboard(folder: Path) -> Series:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    series: Series = {}
    for events in sorted({p.parent for p in folder.rglob("*tfevents*")}):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            for ev in acc.Scalars(tag):
                series.setdefault(tag, {})[int(ev.step)] = float(ev.value)
    return series


def read_run(path: str | Path) -> Series:
    """All scalar series of one run: a .jsonl file, or a folder holding .jsonl and/or tfevents files."""
    path = Path(path)
    if path.is_file():
        if "tfevents" in path.name:
            return read_tensorboard(path.parent)
        return read_jsonl(path)
    if not path.is_dir():
        raise FileNotFoundError(f"run log {path} does not exist")
    series: Series = {}
    for jsonl in sorted(path.rglob("*.jsonl")):
        for key, values in read_jsonl(jsonl).items():
            series.setdefault(key, {}).update(values)
    for key, values in read_tensorboard(path).items():
        series.setdefault(key, {}).update(values)
    if not series:
        raise ValueError(f"no verl JSONL or TensorBoard scalars under {path}")
    return series


def resolve(metric: str, keys: list[str]) -> str | None:
    """The logged key for `metric`: itself when logged, else the first alias pattern that matches."""
    if metric in keys:
        return metric
    for pattern in ALIASES.get(metric, ()):
        hits = sorted(k for k in keys if re.fullmatch(pattern, k))
        if hits:
            return hits[0]
    return None


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def divergence_step(base: dict[int, float], run: dict[int, float], cfg: CurvesConfig) -> int | None:
    """First common step where the smoothed gap leaves `rtol * scale` for `patience` steps in a row."""
    steps = sorted(set(base) & set(run))
    if not steps:
        return None
    b = _smooth([base[s] for s in steps], cfg.smooth)
    r = _smooth([run[s] for s in steps], cfg.smooth)
    scale = max(abs(v) for v in b) or 1.0
    out = [abs(x - y) > cfg.rtol * scale for x, y in zip(b, r)]
    for i in range(len(steps) - cfg.patience + 1):
        if all(out[i : i + cfg.patience]):
            return steps[i]
    return None


def _label_and_path(spec: str) -> tuple[str, str]:
    if "=" in spec and not Path(spec).exists():
        label, path = spec.split("=", 1)
        if not label or not path:
            raise ValueError(f"run {spec!r}: expected label=path")
        return label, path
    p = Path(spec)
    return (p.stem if p.is_file() else p.name), spec


def run(cfg: CurvesConfig) -> dict:
    """Read the runs, resolve metrics, find divergence points, write curves.png and curves.json."""
    from .provenance import environment

    specs = [_label_and_path(spec) for spec in cfg.runs]
    labels = [label for label, _ in specs]
    if len(set(labels)) < len(labels):  # runs are keyed by label: a repeated one would hide a run
        raise ValueError(f"run labels repeat: {labels}; name them with label=path")
    for _, path in specs:  # every path before reading any: a typo in the last fails at once
        if not Path(path).exists():
            raise FileNotFoundError(f"run log {path} does not exist")
    runs = [(label, path, read_run(path)) for label, path in specs]
    metrics = []
    for metric in cfg.metrics:
        keys = {label: resolve(metric, list(series)) for label, _, series in runs}
        if all(k is None for k in keys.values()):
            continue
        base_label, _, base_series = runs[0]
        base_key = keys[base_label]
        diverge = {}
        for label, _, series in runs[1:]:
            if base_key is None or keys[label] is None:
                diverge[label] = None
                continue
            diverge[label] = divergence_step(base_series[base_key], series[keys[label]], cfg)
        metrics.append({"metric": metric, "keys": keys, "divergence_step": diverge})
    if not metrics:
        raise ValueError(f"none of {list(cfg.metrics)} is logged in any run")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    png = out / "curves.png"
    _plot(runs, metrics, png)
    report = {
        "schema": SCHEMA_VERSION,
        "tool": "curves",
        "argv": sys.argv,
        **environment(),
        "config": {"rtol": cfg.rtol, "smooth": cfg.smooth, "patience": cfg.patience, "baseline": runs[0][0]},
        "runs": [{"label": label, "path": str(path), "num_keys": len(s)} for label, path, s in runs],
        "metrics": metrics,
        "plot": str(png),
    }
    (out / "curves.json").write_text(json.dumps(report, indent=2))
    return report


def _plot(runs, metrics: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(metrics)
    fig, axes = plt.subplots(1, n, figsize=(4.5 * n, 3.6), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, m in zip(axes[0], metrics):
        for i, (label, _, series) in enumerate(runs):
            key = m["keys"][label]
            if key is None:
                continue
            steps = sorted(series[key])
            color = colors[i % len(colors)]
            ax.plot(steps, [series[key][s] for s in steps], label=f"{label}", color=color, lw=1.4)
            step = m["divergence_step"].get(label)
            if step is not None:
                ax.axvline(step, color=color, ls="--", lw=1)
                ax.annotate(
                    f"diverges @ {step}",
                    (step, ax.get_ylim()[1]),
                    color=color,
                    fontsize=8,
                    ha="left",
                    va="top",
                    rotation=90,
                )
        ax.set_title(m["metric"] + (f"\n{m['keys'][runs[0][0]]}" if m["keys"][runs[0][0]] else ""), fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def print_report(report: dict) -> None:
    from .table import render_table

    labels = [r["label"] for r in report["runs"]]
    rows = []
    for m in report["metrics"]:
        row = {"metric": m["metric"], f"key ({labels[0]})": m["keys"][labels[0]] or "-"}
        for label in labels[1:]:
            step = m["divergence_step"].get(label)
            row[f"{label} diverges @"] = "-" if step is None else step
        rows.append(row)
    columns = list(rows[0]) if rows else ["metric"]
    render_table(f"verl-moe curves (baseline {labels[0]})", columns, rows)
    print(f"plot: {report['plot']}")


if __name__ == "__main__":  # python -m verl_moe.tools.curves RUN [RUN ...] [--out DIR]
    args = sys.argv[1:]
    out_dir = "curves_out"
    if "--out" in args:
        i = args.index("--out")
        out_dir = args[i + 1]
        args = args[:i] + args[i + 2 :]
    print_report(run(CurvesConfig(runs=tuple(args), out=out_dir)))
