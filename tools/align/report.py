"""What `verl-moe align` shows and writes: the report.json schema, the PNG plots, the terminal table.

`REPORT_SCHEMA` is the JSON Schema of report.json (the fields are listed in `runner.py`'s
docstring); `validate_report` checks a report against it. Plots use matplotlib's Agg backend.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .metrics import METRICS, exceeds
from .trace import BackendTrace

SCHEMA_VERSION = 1
PRECISIONS = ("bf16", "fp32", "fp64")

# ---- report schema -----------------------------------------------------------------------------

_NUM = {"type": ["number", "null"]}
_METRIC_ROW = {
    "type": "object",
    "required": [*METRICS, "grad_cosine"],
    "properties": {**{m: _NUM for m in METRICS}, "grad_cosine": {"type": "object", "additionalProperties": _NUM}},
}
REPORT_SCHEMA: dict = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "verl-moe align report",
    "type": "object",
    "required": [
        "schema",
        "tool",
        "argv",
        "device",
        "device_name",
        "versions",
        "git_sha",
        "source_sha",
        "config",
        "model",
        "stream",
        "golden",
        "backends",
        "pairs",
        "plots",
        "ok",
        "exit_code",
    ],
    "properties": {
        "schema": {"const": SCHEMA_VERSION},
        "tool": {"const": "align"},
        "argv": {"type": "array", "items": {"type": "string"}},
        "device": {"type": "string"},
        "device_name": {"type": "string"},
        "versions": {"type": "object", "additionalProperties": {"type": ["string", "null"]}},
        "git_sha": {"type": ["string", "null"]},
        "source_sha": {"type": "string"},
        "date": {"type": "string"},  # UTC, ISO 8601
        "config": {"type": "object"},
        "model": {
            "type": "object",
            "required": ["path", "preset", "model_type", "num_parameters"],
            "properties": {"num_parameters": {"type": "integer", "minimum": 1}},
        },
        "stream": {
            "type": "object",
            "required": ["source", "steps", "sequences", "tokens", "response_tokens"],
            "properties": {
                "steps": {"type": "integer", "minimum": 1},
                "sequences": {"type": "array", "items": {"type": "integer"}},
                "tokens": {"type": "array", "items": {"type": "integer"}},
                "response_tokens": {"type": "array", "items": {"type": "integer"}},
            },
        },
        "golden": {"type": ["string", "null"]},
        "backends": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "label",
                    "name",
                    "status",
                    "reason",
                    "dtype",
                    "router_dtype",
                    "world_size",
                    "wall_s",
                    "loss",
                    "grad_norm",
                ],
                "properties": {
                    "status": {"enum": ["ok", "skipped", "failed"]},
                    "reason": {"type": ["string", "null"]},
                    "loss": {"type": "array", "items": _NUM},
                    "grad_norm": {"type": "array", "items": _NUM},
                },
            },
        },
        "pairs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "a",
                    "b",
                    "precision",
                    "one_step",
                    "curves",
                    "tolerances",
                    "first_exceeded",
                    "first_divergence_step",
                    "ok",
                ],
                "properties": {
                    "precision": {"enum": list(PRECISIONS)},
                    "one_step": _METRIC_ROW,
                    "curves": {"type": "array", "items": _METRIC_ROW, "minItems": 1},
                    "tolerances": {"type": "object", "additionalProperties": {"type": "number"}},
                    "first_exceeded": {"type": "object", "additionalProperties": {"type": ["integer", "null"]}},
                    "first_divergence_step": {"type": ["integer", "null"]},
                    "ok": {"type": "boolean"},
                },
            },
        },
        "router_ablation": {"type": ["object", "null"]},
        "plots": {"type": "object", "additionalProperties": {"type": "string"}},
        "ok": {"type": "boolean"},
        "exit_code": {"type": "integer"},
    },
}


def validate_report(report: dict) -> None:
    """Raise jsonschema.ValidationError when `report` does not follow REPORT_SCHEMA."""
    import jsonschema

    jsonschema.validate(report, REPORT_SCHEMA)


def json_safe(value):
    """NaN / inf -> None (report.json stays strict JSON; exceedances are decided before this)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


# ---- plots -------------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(pairs: list[dict], png: Path) -> Path:
    """One panel per metric, one line per pair over the K steps; tolerance dashed, first exceedance marked."""
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    metrics = list(METRICS)
    cols = 3
    fig, axes = plt.subplots(math.ceil(len(metrics) / cols), cols, figsize=(13, 9), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, metric in zip(axes.flat, metrics):
        is_cos = METRICS[metric][0] == "min"
        for i, pair in enumerate(pairs):
            color = colors[i % len(colors)]
            ys = [row.get(metric) for row in pair["curves"]]
            ys = [None if y is None else (1 - y if is_cos else y) for y in ys]
            steps = [k for k, y in enumerate(ys) if y is not None]
            vals = [max(ys[k], 1e-18) for k in steps]
            if vals:
                ax.plot(steps, vals, marker="o", ms=3, color=color, label=f"{pair['a']} vs {pair['b']}")
            tol = pair["tolerances"].get(metric)
            if tol is not None:
                ax.axhline(max(1 - tol if is_cos else tol, 1e-18), color=color, ls="--", lw=0.8)
            k = pair["first_exceeded"].get(metric)
            if k is not None and ys[k] is not None:
                ax.plot([k], [max(ys[k], 1e-18)], marker="x", ms=10, mew=2, color=color)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(("1 - " if is_cos else "") + metric + " (0 drawn at 1e-18)", fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    for ax in list(axes.flat)[len(metrics) :]:
        ax.axis("off")
    fig.suptitle("verl-moe align: backend pairs (dashed: tolerance, x: first exceeded)")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def plot_logp_hist(traces: dict[str, BackendTrace], golden: str, labels: list[str], png: Path) -> Path:
    """Histogram of per-token |Δ log-prob| against the golden at step 0 (log-spaced bins)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    ref = traces[golden].steps[0].log_probs
    diffs = {label: (traces[label].steps[0].log_probs - ref).abs() for label in labels}
    positive = torch.cat([d[d > 0] for d in diffs.values()])
    lo, hi = (-16.0, 0.0) if positive.numel() == 0 else (positive.min().log10().item(), positive.max().log10().item())
    bins = torch.logspace(math.floor(lo) - 1, math.ceil(hi) + 1, 40).tolist()
    for label, d in diffs.items():
        zeros = int((d == 0).sum())
        ax.hist(
            d.clamp_min(bins[0]).numpy(),
            bins=bins,
            histtype="step",
            lw=1.5,
            label=f"{label} ({zeros} exact)" if zeros else label,
        )
    ax.set_xscale("log")
    ax.set_xlabel(f"|log-prob - log-prob[{golden}]| per response token, step 0")
    ax.set_ylabel("tokens")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


# ---- terminal ----------------------------------------------------------------------------------


SHORT_NAMES = {
    "logp_abs_diff_mean": "mean |Δlogp|",
    "logp_abs_diff_max": "max |Δlogp|",
    "kl_k3_mean": "KL (k3)",
    "entropy_abs_diff_mean": "mean |Δentropy|",
    "loss_abs_diff": "|Δloss|",
    "grad_norm_rel_diff": "rel Δgrad-norm",
    "grad_cosine_min": "min grad cos",
    "router_flip_rate": "router flips",
    "param_drift": "param drift @K",
}


def _cell(value, metric: str | None = None, tol: float | None = None) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        close_to_one = metric is not None and METRICS[metric][0] == "min" and 0.99 < value < 1
        text = f"1-{1 - value:.2g}" if close_to_one else f"{value:.3g}"
        if metric is not None and tol is not None and exceeds(metric, value, tol):
            text += " (!)"
        return text
    return str(value)


def _first_out(pair: dict) -> str:
    """'step k (metrics)' of the pair's first step out of tolerance, '-' when it never leaves."""
    k = pair["first_divergence_step"]
    if k is None:
        return "-"
    hit = [m for m, s in pair["first_exceeded"].items() if s == k]
    return f"step {k} ({', '.join(hit) if len(hit) <= 2 else f'{len(hit)} metrics'})"


def table_rows(report: dict) -> tuple[list[str], list[dict]]:
    """The terminal table, transposed so it fits a terminal: one row per setting / metric, one column
    per backend; step-0 metrics against the golden, `(!)` where a value is outside its tolerance."""
    by_b = {p["b"]: p for p in report["pairs"] if p["a"] == report["golden"]}
    columns = ["metric", *(be["label"] for be in report["backends"])]
    rows = [
        {"metric": "dtype/router/ranks"}
        | {be["label"]: f"{be['dtype']}/{be['router_dtype']}/{be['world_size']}" for be in report["backends"]},
        {"metric": "wall s"} | {be["label"]: _cell(be["wall_s"]) for be in report["backends"]},
    ]
    for metric in METRICS:
        row = {"metric": SHORT_NAMES[metric]}
        for be in report["backends"]:
            pair = by_b.get(be["label"])
            if pair is not None:
                value = pair["curves"][-1 if metric == "param_drift" else 0][metric]
                row[be["label"]] = _cell(value, metric, pair["tolerances"].get(metric))
            else:
                row[be["label"]] = ""
        rows.append(row)
    verdict = {"metric": "first out of tol."}
    status = {"metric": "verdict"}
    for be in report["backends"]:
        pair = by_b.get(be["label"])
        if be["label"] == report["golden"]:
            verdict[be["label"]], status[be["label"]] = "", "golden"
        elif pair is None:
            verdict[be["label"]], status[be["label"]] = "", be["status"]
        else:
            verdict[be["label"]] = _first_out(pair)
            status[be["label"]] = "ok" if pair["ok"] else "EXCEEDED"
    # one header line per backend option, so long labels wrap instead of being cut
    head = {c: c.replace(":", "\n:") for c in columns}
    return [head[c] for c in columns], [{head[k]: v for k, v in r.items()} for r in [*rows, verdict, status]]


def other_pair_rows(pairs: list[dict]) -> tuple[list[str], list[dict]]:
    """One row per pair of non-golden backends: the step-0 metrics, the first step out of tolerance."""
    columns = ["pair", "precision", *(SHORT_NAMES[m] for m in METRICS), "first out of tol."]
    rows = []
    for pair in pairs:
        row = {"pair": f"{pair['a']} vs {pair['b']}", "precision": pair["precision"]}
        for metric in METRICS:
            value = pair["curves"][-1 if metric == "param_drift" else 0][metric]
            row[SHORT_NAMES[metric]] = _cell(value, metric, pair["tolerances"].get(metric))
        row["first out of tol."] = _first_out(pair)
        rows.append(row)
    return columns, rows


def print_report(report: dict) -> None:
    from ..table import render_table

    k = report["stream"]["steps"]
    title = (
        f"verl-moe align: {report['model']['model_type']} ({report['model']['num_parameters']:,} params), "
        f"{k} step(s), golden {report['golden']}, on {report['device_name']}"
    )
    columns, rows = table_rows(report)
    render_table(title, columns, rows)
    others = [p for p in report["pairs"] if p["a"] != report["golden"]]
    if others:
        render_table("pairs without the golden (step 0; param drift at step K)", *other_pair_rows(others))
    for be in report["backends"]:
        if be["status"] != "ok":
            print(f"{be['status']} {be['label']}: {be['reason']}")
    if report["config"].get("jobs", 1) > 1:
        print(f"workers ran {report['config']['jobs']} at a time: their wall times overlap")
    for name, path in report["plots"].items():
        print(f"plot {name}: {path}")
    print(f"report: {Path(report['config']['out']) / 'report.json'}")
    if not report["pairs"]:
        print("no backend pair was compared (see the failed backends above)")
    print("ALIGNED" if report["ok"] else "NOT ALIGNED (exit 1)")
