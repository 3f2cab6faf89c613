"""Write BENCHMARKS.md from the reports in results/ (its only input; stdlib only, so it runs anywhere).

    python scripts/benchmarks_md.py            # rewrite BENCHMARKS.md
    python scripts/benchmarks_md.py --check    # exit 1 when BENCHMARKS.md is not what results/ gives

Each `results/*.json` is one report, as the tools write it (`verl-moe bench ... --json F`, `verl-moe align
--out DIR` -> DIR/report.json) or as `benchmarks/grpo.sh` writes it for a verl `main_ppo` run (its per-step
metrics in the JSONL file the record names), or as `benchmarks/mtp_bench.py` writes it (speculative decoding).
Every report carries argv, versions, device, date and the code it ran (`git_sha`, `source_sha`; `code_commit`
where the recorded git sha was of a stale copy of the tree).
A report this script does not recognise is an error, so results/ holds nothing that BENCHMARKS.md omits.

Tables: one per op (`tool: bench`, every op but `model`, `rollout` and the integrations), the model step
(`op: model`, cases without `-ckpt`), memory (`op: model`, the `-ckpt` cases), our kernels inside the anchors'
models (`op: veomni`, `op: transformers`), decoding (`op: rollout`), the rollout (`tool: main_ppo`) and
alignment (`tool: align`). Each table is followed by the command(s) that reproduce it and
where they ran. Current numbers only: a new measurement replaces the report it supersedes (same file
name); history is git's. Supporting logs that docs/ cite (profiles, memory-peak replays) sit in
results/logs/ and are not read here.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
OUT = ROOT / "BENCHMARKS.md"

OP_TITLES = {
    "gdn": "gdn: chunked gated delta rule (H=16 q/k heads, HV=32 value heads, K=V=128; q/k l2-normalised in the op)",
    "norm": "norm: RMSNorm variants (residual add + (1+w) norm; q-norm on the strided q_proj view; gated)",
    "rope": "rope: q (strided) and k rotated in one launch, partial rotary",
    "conv1d": "conv1d: depthwise causal conv + SiLU over packed sequences",
    "router": "router: fp32 gate logits, softmax, top-k, renormalisation",
    "attention": "attention: packed causal GQA attention (H16 / HKV2, K=256)",
    "experts": "experts: routed SwiGLU experts (token moves + grouped GEMM)",
    "logprob": "logprob: LM head + temperature + log-prob + entropy without [N, VOCAB] logits",
}
# `verl-moe bench veomni` / `bench transformers` (tools/bench/veomni.py, tools/bench/transformers.py): the anchor
# provider of each, the one its other rows are compared with
INTEGRATION_ANCHORS = {"veomni": "veomni", "transformers": "transformers"}
VERSION_KEYS = ("torch", "triton", "transformers", "verl", "fla-core", "liger-kernel", "veomni", "megatron-core", "ray")


# ---- formatting ---------------------------------------------------------------------------------------


def num(v, digits: int = 4) -> str:
    """A measured number for a table: thousands separators above 1000, else `digits` significant digits."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "**no**"
    if isinstance(v, int):
        return f"{v:,}"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if v != 0 and abs(v) < 1e-3:
        return f"{v:.{digits - 2}e}"
    return f"{v:.{digits}g}"


def sci(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2e}"


def pct(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return "0" if v == 0 else f"{100 * v:.{1 if 100 * v >= 0.1 else 3}f}%"


def cosine(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"1-{1 - v:.1e}" if v > 0.999 else f"{v:.4f}"


def table(header: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> str:
    sep = ["---:" if i in right else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(sep) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# ---- what every report says about itself --------------------------------------------------------------


def env_assignments(report: dict) -> list[str]:
    """What the run set in its environment (`env`: e.g. an op's implementation through VERL_MOE_OPS)."""
    return [f"{k}={v}" for k, v in report.get("env", {}).items()]


def command(report: dict, name: str) -> str:
    """The report's argv as a command that writes the same report again, into results/."""
    argv = list(report["argv"])
    if report["tool"] == "main_ppo":
        return " ".join(shlex.quote(a) for a in ["python", *argv])
    if report["tool"] == "mtp_bench":
        argv = ["python", *argv]
    else:
        argv[0] = "verl-moe"
    argv = env_assignments(report) + argv
    for flag, value in (("--json", f"results/{name}.json"), ("--out", f"align_out/{name}")):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
    return " ".join(shlex.quote(a) for a in argv)


def environment(report: dict) -> str:
    """Device, date and versions of one report."""
    versions = report.get("versions", {})
    parts = [f"{k} {versions[k]}" for k in VERSION_KEYS if versions.get(k)]
    return f"{report['device_name']}, {report['date']}; {', '.join(parts)}"


def code(report: dict) -> str:
    """The code a report ran: the commit (`code_commit`, else the recorded git sha) and the sources' hash."""
    if report.get("code_commit"):
        text = f"commit {report['code_commit'][:7]}"
    elif report.get("git_sha"):
        text = f"git sha {report['git_sha'][:7]} as recorded"
    else:
        text = "git sha not recorded"
    return text + (f", sources {report['source_sha']}" if report.get("source_sha") else "")


def footer(reports: list[tuple[str, dict]]) -> str:
    """The commands that reproduce a table, then where and on what code they ran."""
    lines = ["Reproduce:", "", "```bash"]
    for name, rep in reports:
        if rep["tool"] == "main_ppo" and rep.get("setup_argv"):
            lines.append(" ".join(shlex.quote(a) for a in ["python", *rep["setup_argv"]]))
        lines.append(command(rep, name))
    lines += ["```", ""]
    envs: dict[str, dict[str, list[str]]] = {}
    for name, rep in reports:
        envs.setdefault(environment(rep), {}).setdefault(code(rep), []).append(name)
    for env, codes in envs.items():
        if len(codes) == 1:
            where = f"code: {next(iter(codes))}"
        else:
            where = "; ".join(f"code of {', '.join(f'`{n}`' for n in names)}: {c}" for c, names in codes.items())
        lines.append(f"Measured on {env}; {where}.")
    return "\n".join(lines)


# ---- sections -----------------------------------------------------------------------------------------


def _ours(row: dict) -> str | None:
    key = next((k for k in row if k.startswith("ratio_") and k.endswith("_over_this")), None)
    return key[len("ratio_") : -len("_over_this")] if key else None


def op_section(op: str, reports: list[tuple[str, dict]]) -> str:
    rows = [r for _, rep in reports for r in rep["rows"]]
    names = [name for name, rep in reports for _ in rep["rows"]]
    ours = _ours(rows[0]) or "ours"
    kernels = any(r.get("kernel_ms") is not None and not math.isnan(r["kernel_ms"]) for r in rows)
    # a case measured by two reports (a repeat of some cases): each row names its report
    keys = [(r["case"], r["mode"], r["provider"]) for r in rows]
    by_report = len(set(keys)) < len(keys)
    header = ["case", "mode", "provider", "ms"] + (["kernel ms"] if kernels else [])
    header += ["peak above inputs GiB", "rel-RMS vs reference", "check", f"{ours} ms / this ms"]
    if kernels:
        header.append(f"{ours} kernel ms / this")
    if by_report:
        header.append("report")
    body = []
    for r, name in zip(rows, names):
        line = [r["case"], r["mode"], f"**{r['provider']}**" if r["provider"] == ours else r["provider"], num(r["ms"])]
        if kernels:
            line.append(num(r.get("kernel_ms")))
        line += [num(r["peak_extra_gib"], 3), sci(r["rel_rms_vs_ref"]), num(r["check_ok"])]
        line.append(num(r.get(f"ratio_{ours}_over_this"), 3))
        if kernels:
            line.append(num(r.get(f"kernel_ratio_{ours}_over_this"), 3))
        if by_report:
            line.append(f"`{name}`")
        body.append(line)
    right = {i for i, h in enumerate(header) if h not in ("case", "mode", "provider", "report")}
    return f"### {OP_TITLES.get(op, op)}\n\n{table(header, body, right)}{_skipped_note(reports)}\n\n{footer(reports)}"


def _mfu_header(rows: list[dict]) -> str:
    # Rows with `flops` divide models/flops.py's count; older rows divided 6 x active parameters x tokens.
    return "MFU (model FLOPs)" if all("flops" in r for r in rows) else "MFU (6·N·T)"


def _step_cells(r: dict) -> list[str]:
    """A training-step row's ms, kernel ms, busy share, tokens/s, MFU, peak GiB and loss difference cells
    (a row that did not run: why, and the memory it asked for)."""
    if "error" in r:
        gib = r.get("asked_gib", float("nan"))  # only out-of-memory rows carry it; NaN: no allocation named
        asked = f" (asked for {num(gib, 3)} GiB)" if gib == gib else ""
        return [f"not run: {r['error'].split(':')[0]}{asked}"] + [""] * 6
    return [
        num(r["ms"]),
        num(r.get("kernel_ms")),
        pct(r["kernel_ms"] / r["ms"] if r.get("kernel_ms") == r.get("kernel_ms") else None),
        num(r["tokens_per_s"]),
        pct(r["mfu"]),
        num(r["peak_gib"], 3),
        sci(r["rel_rms_vs_ref"]),
    ]


def _skipped_note(reports: list[tuple[str, dict]]) -> str:
    skipped = {p: why for _, rep in reports for p, why in rep.get("skipped_providers", {}).items()}
    return "".join(f"\n\nSkipped provider `{p}`: {why}" for p, why in skipped.items())


def model_section(reports: list[tuple[str, dict]]) -> str:
    named = [(name, r) for name, rep in reports for r in rep["rows"]]
    rows = [r for _, r in named]
    ours = _ours(rows[0]) or "ours"
    header = ["case", "provider", "ms", "kernel ms", "busy", "tokens/s", _mfu_header(rows), "peak GiB"]
    header.append("loss rel. diff")
    header += [f"{ours} ms / this ms", "report"]
    body = [
        [
            r["case"] + (" (fwd)" if r.get("mode") == "fwd" else ""),
            f"**{r['provider']}**" if r["provider"] == ours else r["provider"],
        ]
        + _step_cells(r)
        + [num(r.get(f"ratio_{ours}_over_this"), 3), name]
        for name, r in named
    ]
    right = set(range(2, len(header) - 1))
    return f"{table(header, body, right)}\n\n{footer(reports)}"


def integration_section(op: str, reports: list[tuple[str, dict]]) -> str:
    """One table per integration bench: per case, each provider's step against the anchor's (same process)."""
    rows = [r for _, rep in reports for r in rep["rows"]]
    ours = _ours(rows[0]) or "ours"
    anchor_name = INTEGRATION_ANCHORS[op]
    anchors = {(r["case"], r["mode"]): r for r in rows if r["provider"] == anchor_name}
    fla = any("fla" in r for r in rows)
    # tools/bench/integrations.py::step_row divides models/flops.py's count (the rows do not carry it)
    header = ["case", "provider"] + (["fla"] if fla else []) + ["ms", "kernel ms", "busy", "tokens/s"]
    header.append("MFU (model FLOPs)")
    header += ["peak GiB", "loss rel. diff", "tokens/s / anchor's", "peak / anchor's"]
    body = []
    for r in rows:
        anchor = anchors.get((r["case"], r["mode"]))
        line = [r["case"], f"**{r['provider']}**" if r["provider"] == ours else r["provider"]]
        if fla:
            line.append("yes" if r.get("fla") else "no")
        measured = anchor and "error" not in r and "error" not in anchor
        line += _step_cells(r) + [
            f"{num(r['tokens_per_s'] / anchor['tokens_per_s'], 3)}x" if measured else "-",
            num(r["peak_gib"] / anchor["peak_gib"], 3) if measured else "-",
        ]
        body.append(line)
    right = {i for i, h in enumerate(header) if h not in ("case", "provider", "fla")}
    return f"{table(header, body, right)}{_skipped_note(reports)}\n\n{footer(reports)}"


def _units(row: dict) -> str:
    units = row.get("checkpoint_units") or ("tiles" if row.get("offload") else "layer")
    return "16,384-token tiles" if units == "tiles" else "per layer"


def memory_section(reports: list[tuple[str, dict]]) -> str:
    header = ["tokens", "checkpoint units", "offload", "step ms", "activation peak GiB", "peak GiB", "host GiB"]
    header += ["tokens/s", "report"]
    body = []
    for name, rep in reports:
        for r in rep["rows"]:
            tokens = r["case"].split("-T")[-1].split("-")[0]
            body.append(
                [
                    num(int(tokens)),
                    _units(r),
                    num(bool(r.get("offload"))).replace("**no**", "no"),
                    num(r["ms"]),
                    num(r["peak_extra_gib"], 3),
                    num(r["peak_gib"], 3),
                    num(r.get("host_gib", 0.0), 3),
                    num(r["tokens_per_s"]),
                    f"`{name}`",
                ]
            )
    right = {0, 3, 4, 5, 6, 7}
    return f"{table(header, body, right)}\n\n{footer(reports)}"


def metric_steps(report: dict) -> list[dict]:
    """The per-step records of a main_ppo report (verl's file logger, one JSON object a line)."""
    lines = (RESULTS / report["metrics"]).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def rollout_section(reports: list[tuple[str, dict]]) -> str:
    parts = []
    header = ["step", "generation s", "generation tokens/s", "response length", "old log-prob s", "reference s"]
    header += ["actor update s", "update tokens/s", "weight sync s", "step s", "rollout probs diff (mean)"]
    header += ["actor/ppo_kl", "trainer peak GiB"]
    for name, rep in reports:
        key = "actor_rollout_ref.rollout.free_cache_engine="
        free = next((a[len(key) :] for a in rep["argv"] if a.startswith(key)), "true (verl's default)")
        parts.append(f"`{name}`: `free_cache_engine={free}`")
        steps = metric_steps(rep)
        body = []
        for s in steps:
            d = s["data"]
            if "timing_s/gen" not in d:
                continue
            body.append(
                [
                    str(s["step"]),
                    num(d["timing_s/gen"]),
                    num(1000 / d["timing_per_token_ms/gen"]),
                    num(d["response_length/mean"]),
                    num(d.get("timing_s/old_log_prob")),
                    num(d.get("timing_s/ref")),
                    num(d["timing_s/update_actor"]),
                    num(1000 / d["timing_per_token_ms/update_actor"]),
                    num(d.get("timing_s/update_weights")),
                    num(d["timing_s/step"]),
                    sci(d.get("training/rollout_probs_diff_mean")),
                    sci(d.get("actor/ppo_kl")),
                    num(d.get("actor/perf/max_memory_allocated_gb"), 3),
                ]
            )
        parts.append(table(header, body, set(range(len(header)))))
    return "\n\n".join(parts) + f"\n\n{footer(reports)}"


def is_ppo(report: dict) -> bool:
    """A main_ppo report of a run with a critic (benchmarks/ppo.sh's recipe)."""
    return "tiny_cpu_ppo" in report["argv"]


# verl's timing_s/* keys of a PPO step, in the table's order
PPO_TIMINGS = ("gen", "old_log_prob", "values", "update_critic", "update_actor", "update_weights", "step")


def ppo_section(reports: list[tuple[str, dict]]) -> str:
    header = ["step", "generation s", "old log-prob s", "values s", "critic update s", "actor update s"]
    header += ["weight sync s", "step s", "critic/vf_loss", "critic/values/mean", "trainer peak GiB"]
    parts = []
    for name, rep in reports:
        steps = metric_steps(rep)
        body = [
            [str(s["step"])]
            + [num(s["data"].get(f"timing_s/{k}")) for k in PPO_TIMINGS]
            + [num(s["data"]["critic/vf_loss"], 4), sci(s["data"]["critic/values/mean"])]
            + [num(s["data"].get("actor/perf/max_memory_allocated_gb"), 3)]
            for s in steps
            if "timing_s/gen" in s["data"]
        ]
        parts += [f"`{name}`", table(header, body, set(range(len(header))))]
    return "\n\n".join(parts) + f"\n\n{footer(reports)}"


def decode_section(reports: list[tuple[str, dict]]) -> str:
    header = ["provider", "batch", "step ms", "first pass ms", "cold ms", "prefill ms", "tokens/s", "vs transformers"]
    header += ["floor ms", "peak GiB"]
    rows = []
    for _, rep in reports:
        uniform = [r for r in rep["records"] if r.get("case", "uniform") == "uniform"]
        anchor = next((r for r in uniform if r["provider"] == "transformers" and "error" not in r), None)
        env = ", ".join(env_assignments(rep))
        for r in uniform:
            r = {**r, "provider": f"{r['provider']} ({env})" if env else r["provider"]}
            if "error" in r:
                rows.append([r["provider"], str(r["batch"]), f"failed: {r['error']}"] + [""] * (len(header) - 3))
                continue
            ratio = r["tokens_per_s"] / anchor["tokens_per_s"] if anchor else float("nan")
            rows.append(
                [
                    r["provider"],
                    str(r["batch"]),
                    num(r["decode_step_ms"], 3),
                    num(r["first_pass_step_ms"], 3),
                    num(r["cold_step_ms"], 3),
                    num(r["prefill_ms"], 3),
                    num(r["tokens_per_s"], 3),
                    f"{num(ratio, 3)}x" if anchor else "-",
                    num(r["floor_step_ms"], 3),
                    num(r["peak_GiB"], 3),
                ]
            )
    return table(header, rows, right=set(range(1, len(header)))) + "\n\n" + footer(reports)


def decode_rl_section(reports: list[tuple[str, dict]]) -> str:
    """`verl-moe bench rollout --case rl`: a fresh engine per batch against one kept, the anchor transformers."""
    header = ["provider", "batch", "tokens", "fresh s", "build ms", "prefill ms", "decode ms", "step ms"]
    header += ["tokens/s", "kept s", "kept tokens/s", "fresh / kept", "vs transformers", "cold s", "peak GiB"]
    rows = []
    for _, rep in reports:
        rl = [r for r in rep["records"] if r.get("case") == "rl"]
        anchor = next((r for r in rl if r["provider"] == "transformers" and "error" not in r), None)
        for r in rl:
            if "error" in r:
                rows.append([r["provider"], str(r["batch"]), f"failed: {r['error']}"] + [""] * (len(header) - 3))
                continue
            ratio = r["tokens_per_s"] / anchor["tokens_per_s"] if anchor else float("nan")
            kept = "kept_s" in r
            rows.append(
                [
                    r["provider"],
                    str(r["batch"]),
                    str(r["tokens"]),
                    num(r["fresh_s"], 3),
                    num(r.get("build_ms"), 3) if kept else "-",
                    num(r.get("prefill_ms"), 3) if kept else "-",
                    num(r.get("decode_ms"), 3) if kept else "-",
                    num(r.get("decode_step_ms"), 3) if kept else "-",
                    num(r["tokens_per_s"], 3),
                    num(r["kept_s"], 3) if kept else "-",
                    num(r["kept_tokens_per_s"], 3) if kept else "-",
                    f"{num(r['fresh_s'] / r['kept_s'], 3)}x" if kept else "-",
                    f"{num(ratio, 3)}x" if anchor else "-",
                    num(r["cold_s"], 3),
                    num(r["peak_GiB"], 3),
                ]
            )
    return table(header, rows, right=set(range(1, len(header)))) + "\n\n" + footer(reports)


def exact_section(reports: list[tuple[str, dict]]) -> str:
    header = ["device", "mode", "tokens", "mismatched", "max abs Δ log-prob", "mean abs Δ", "decode step ms"]
    header += ["train step ms", "train tokens", "peak GiB"]
    rows = []
    for _, rep in reports:
        for r in (r for r in rep["records"] if r["mode"] in ("fast", "exact")):
            decode, train = num(r["decode_step_ms"], 3), num(r["train_step_ms"], 4)
            if "decode_ratio" in r:
                decode, train = f"{decode} ({num(r['decode_ratio'], 3)}x)", f"{train} ({num(r['train_ratio'], 3)}x)"
            rows.append(
                [
                    rep["device_name"],
                    r["mode"],
                    str(r["tokens"]),
                    str(r["mismatched_tokens"]),
                    num(r["max_abs_logprob_diff"], 4),
                    num(r["mean_abs_logprob_diff"], 3),
                    decode,
                    train,
                    str(r["train_tokens"]),
                    num(r["peak_GiB"], 3),
                ]
            )
    table_md = table(header, rows, right=set(range(2, len(header))))
    for _, rep in reports:
        ablation = [r for r in rep["records"] if r["mode"] == "ablation"]
        if ablation:
            table_md += f"\n\n{rep['device_name']}: " + ablation_table(ablation)
    return table_md + "\n\n" + footer(reports)


def ablation_table(records: list[dict]) -> str:
    """Fast mode's rollout-vs-trainer mismatch by op: the fast model with one op group exact, the exact model with
    one op group fast (`tools/bench/exact.py::_ablation`)."""
    by = {(r["op"], r["direction"]): r for r in records}
    fast, exact = by[("all", "fast")], by[("all", "exact")]
    lines = [
        f"where fast mode's mismatch comes from ({fast['requests']} of the requests, {fast['tokens']} response "
        f"tokens; all fast: mean {num(fast['mean_abs_logprob_diff'], 3)}, max {num(fast['max_abs_logprob_diff'], 3)}; "
        f"all exact: {exact['mismatched_tokens']} tokens differ):",
        "",
        "",
    ]
    header = ["op", "only this op exact: mean abs Δ", "max abs Δ", "only this op fast: mean abs Δ", "max abs Δ"]
    header.append("only this op fast: tokens differing")
    rows = []
    for op in dict.fromkeys(r["op"] for r in records if r["op"] != "all"):
        one_exact, one_fast = by[(op, "exact_only")], by[(op, "fast_only")]
        rows.append(
            [
                op,
                num(one_exact["mean_abs_logprob_diff"], 3),
                num(one_exact["max_abs_logprob_diff"], 3),
                num(one_fast["mean_abs_logprob_diff"], 3),
                num(one_fast["max_abs_logprob_diff"], 3),
                str(one_fast["mismatched_tokens"]),
            ]
        )
    return "\n".join(lines) + table(header, rows, right=set(range(1, len(header))))


def mtp_section(reports: list[tuple[str, dict]]) -> str:
    header = ["requests", "k", "acceptance", "plain tokens/s", "speculative tokens/s", "speedup", "rollout path"]
    parts = []
    for name, rep in reports:
        parts.append(
            f"`{name}`: trained {rep['train_steps']:,} step{'s' * (rep['train_steps'] != 1)} in "
            f"{rep['train_s']:.0f} s, next-token loss "
            f"{rep['loss']:.3f}, MTP loss {rep['mtp_loss']:.3f}; the model's mean next-token entropy "
            f"{rep['mean_entropy']:.3f} nats (the corpus's {rep['corpus_entropy']:.3f})."
        )
        body = [
            [num(r["requests"]), num(r["k"]), pct(r["acceptance"]), num(r["plain_tokens_per_s"])]
            + [num(r["spec_tokens_per_s"]), num(r["speedup"], 3) + "x", r.get("path", "-")]
            for r in rep["records"]
        ]
        parts.append(table(header, body, set(range(len(header)))))
    return "\n\n".join(parts) + f"\n\n{footer(reports)}"


def align_section(name: str, rep: dict) -> str:
    golden = rep["golden"]
    backends = {b["label"]: b for b in rep["backends"]}

    def same_precision(a: str, b: str) -> bool:
        x, y = backends[a], backends[b]
        return (x["dtype"], x["router_dtype"]) == (y["dtype"], y["router_dtype"])

    pairs = [p for p in rep["pairs"] if p["a"] == golden] + [
        p for p in rep["pairs"] if p["a"] != golden and same_precision(p["a"], p["b"])
    ]
    last = rep["config"]["steps"] - 1
    header = ["pair", "dtype / router", "mean \\|Δlogp\\| @0", "max \\|Δlogp\\| @0", "router flips @0"]
    header += ["min grad cos @0", f"mean \\|Δlogp\\| @{last}", f"flips @{last}", "first step out of tol.", "ok"]
    body = []
    for p in pairs:
        b, s0, end = backends[p["b"]], p["one_step"], p["curves"][-1]
        body.append(
            [
                f"{p['b']} vs {p['a']}",
                f"{b['dtype']} / {b['router_dtype']}",
                sci(s0["logp_abs_diff_mean"]),
                sci(s0["logp_abs_diff_max"]),
                pct(s0["router_flip_rate"]),
                cosine(s0["grad_cosine_min"]),
                sci(end["logp_abs_diff_mean"]),
                pct(end["router_flip_rate"]),
                "-" if p["first_divergence_step"] is None else str(p["first_divergence_step"]),
                num(p["ok"]),
            ]
        )
    model = rep["model"]
    stream = rep["stream"]
    title = (
        f"### `{model['preset'] or model['path']}` ({model['model_type']}, {num(model['num_parameters'])} parameters), "
        f"K={rep['config']['steps']}"
    )
    what = (
        f"{sum(stream['sequences'])} sequences, {num(sum(stream['tokens']))} tokens over the steps; "
        f"golden `{golden}`; {len(rep['pairs'])} pairs in the report, here those against the golden and "
        f"those of two backends at the same precision. Report: `results/{name}.json` (the `--out` folder's "
        f"report.json); plot: `results/{name}.png`."
    )
    return f"{title}\n\n{what}\n\n{table(header, body, set(range(2, len(header))))}\n\n{footer([(name, rep)])}"


# ---- the page -----------------------------------------------------------------------------------------

HEAD = """# Benchmarks

Generated by `python scripts/benchmarks_md.py` from the reports in `results/`; do not edit by hand.
How the numbers are measured, what each column means and how to add a report: `docs/benchmarking.md`.
Current numbers only: a new measurement replaces the report it supersedes; earlier ones are in git
history. Every table ends with the command that reproduces it and the device, date, versions and code
it ran on. Ratios compare providers measured in the same process."""


def natural(path: Path) -> list:
    """Sort key: digit runs compare as numbers (T4096 before T16384)."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.stem)]


def load() -> dict[str, dict]:
    reports = {}
    for path in sorted(RESULTS.glob("*.json"), key=natural):
        rep = json.loads(path.read_text())
        kind = rep.get("tool")
        if kind not in ("bench", "align", "main_ppo", "mtp_bench") or "argv" not in rep or "date" not in rep:
            raise SystemExit(f"{path}: not a report (needs tool bench / align / main_ppo / mtp_bench, argv and date)")
        if kind == "main_ppo" and not (RESULTS / rep["metrics"]).is_file():
            raise SystemExit(f"{path}: its metrics file results/{rep['metrics']} is missing")
        reports[path.stem] = rep
    return reports


def render(reports: dict[str, dict]) -> str:
    bench = [(n, r) for n, r in reports.items() if r["tool"] == "bench"]
    ops = [(n, r) for n, r in bench if r["op"] not in ("model", "rollout", "exact", *INTEGRATION_ANCHORS)]
    exact = [(n, r) for n, r in bench if r["op"] == "exact"]
    integrations = {op: [(n, r) for n, r in bench if r["op"] == op] for op in INTEGRATION_ANCHORS}
    decode = [(n, r) for n, r in bench if r["op"] == "rollout"]
    model = [(n, r) for n, r in bench if r["op"] == "model"]
    step = [(n, r) for n, r in model if not any(row["case"].endswith("-ckpt") for row in r["rows"])]
    memory = [(n, r) for n, r in model if (n, r) not in step]
    rollout = [(n, r) for n, r in reports.items() if r["tool"] == "main_ppo" and not is_ppo(r)]
    ppo = [(n, r) for n, r in reports.items() if r["tool"] == "main_ppo" and is_ppo(r)]
    align = [(n, r) for n, r in reports.items() if r["tool"] == "align"]
    mtp = [(n, r) for n, r in reports.items() if r["tool"] == "mtp_bench"]

    sections = [
        HEAD,
        "## Ops",
        "Forward + backward unless the mode says `fwd`; bf16 inputs; median of the timed calls.",
    ]
    measured = [op for op in OP_TITLES if any(r["op"] == op for _, r in ops)]
    others = sorted({r["op"] for _, r in ops} - set(OP_TITLES))
    for op in measured + others:
        sections.append(op_section(op, [(n, r) for n, r in ops if r["op"] == op]))
    missing = [op for op in OP_TITLES if op not in measured]
    if missing:
        names = ", ".join(f"`{op}`" for op in missing)
        sections.append(f"No report in results/ yet for {names}: `bash benchmarks/ops.sh` writes them.")
    if step:
        sections += [
            "## Model step",
            "One training step (forward, next-token log-prob loss, backward) of the reduced Qwen3.5-MoE "
            "(`tools/bench/model.py::reduced_config(8)`: hidden 2048, 6 GatedDeltaNet + 2 attention layers, "
            "64 experts "
            "top-8 + shared expert, vocabulary 248,320), bf16, every provider from the same weights in one process. "
            "Peak = the provider's weights + the step's peak above them. MFU divides by 790 TFLOP/s (a measured "
            "dense bf16 rate); the column says which FLOP count the report used (docs/benchmarking.md).",
            model_section(step),
        ]
    if memory:
        sections += [
            "## Memory: long sequences, checkpointing and activation offload",
            "The same reduced model, one sequence, activation checkpointing; the step keeps its gradients between "
            "steps (zeroed in place), so the activation peak is the step's peak above the weights and their "
            "gradients. Each row is its own process (one report each).",
            memory_section(memory),
        ]
    if any(integrations.values()):
        sections += [
            "## Our kernels inside the anchors' models",
            "The model step's reduced Qwen3.5-MoE (same config, weights and bf16; one training step: forward with "
            "the next-token loss, backward) run by another project's model code, each pair from the same weights "
            "in one process (docs/integrations.md). Peak = the provider's weights + the step's peak above them; "
            "the last two columns divide by the anchor's row of the same case (`veomni`, `transformers`). MFU "
            "divides models/flops.py's count by 790 TFLOP/s.",
        ]
    if integrations["veomni"]:
        sections += [
            "### VeOmni's model: `verl_moe` in every slot vs VeOmni's default GPU kernels",
            "`verl-moe bench veomni` (tools/bench/veomni.py): VeOmni 0.1.12's `build_foundation_model`, "
            "sdpa attention, its Triton load-balancing loss in both; `verl_moe` = our op in every served slot "
            "(GDN, conv1d, RMSNorm, gated RMSNorm, MoE experts, fused cross-entropy head), `veomni` = fla GDN / "
            "conv / gated norm, Liger RMSNorm and fused cross-entropy, VeOmni's Triton group-GEMM MoE. The N16 "
            "case packs 16 sequences (`cu_seq_lens_q/k`).",
            integration_section("veomni", integrations["veomni"]),
        ]
    if integrations["transformers"]:
        sections += [
            "### transformers' model: `apply_to_qwen3_5_moe` vs unpatched",
            "`verl-moe bench transformers` (tools/bench/transformers.py): `Qwen3_5MoeForCausalLM`, sdpa "
            "attention, grouped_mm experts where not patched, full logits and the loss in fp32; `verl_moe` = "
            "patched, `transformers` = unpatched with fla's GDN kernels and gated norm (`fla`: fla in the step), "
            "`transformers_torch` = unpatched on transformers' torch GatedDeltaNet. One sequence per case "
            "(transformers' GatedDeltaNet ignores packing).",
            integration_section("transformers", integrations["transformers"]),
        ]
    if decode:
        sections += [
            "## Rollout: decoding with our engine",
            "`verl-moe bench rollout` (tools/bench/rollout.py): the reduced Qwen3.5-MoE with 4 layers "
            "(3 GatedDeltaNet + 1 attention, vocabulary 248,320), random weights, bf16; 256 prompts of 128 tokens, "
            "256 new tokens each, temperature 1, log-probs on (transformers: none). Cold = a fresh engine's first "
            "batch; first pass = a batch of new lengths after a warm-up batch of others; step = the same lengths "
            "again; floor = bytes a step must move over the measured copy bandwidth. Tokens/s include the prefill.",
            decode_section(
                [(n, r) for n, r in decode if any(x.get("case", "uniform") == "uniform" for x in r["records"])]
            ),
        ]
    if any(r.get("case") == "rl" for _, rep in decode for r in rep["records"]):
        sections += [
            "### RL-shaped batches",
            "`verl-moe bench rollout --case rl`: 256 requests, prompt lengths uniform in 32-512 and stops uniform in "
            "16-256 (fixed seeds, `ignore_eos`), one `generate` call each. Fresh = a new engine per batch, as verl's "
            "`free_cache_engine=true` gives every step (build = its constructor; it allocates its slots in the "
            "prefill and captures its device graphs in the decode); kept = one engine across batches; cold = the "
            "first batch of the process (compiles). transformers: one left-padded generate, every row run to the "
            "longest stop, with the kernels the machine has (without fla: its torch gated delta rule). Tokens/s "
            "count the tokens the requests asked for.",
            decode_rl_section([(n, r) for n, r in decode if any(x.get("case") == "rl" for x in r["records"])]),
        ]
    if exact:
        sections += [
            "## Exact mode against fast mode",
            "`verl-moe bench exact` (tools/bench/exact.py): the reduced Qwen3.5-MoE with 4 layers, "
            "vocabulary 248,320, bf16, 256 RL-shaped requests (prompts 32-512 tokens, 16-256 new tokens, fixed "
            "seeds); the rollout's log-prob of each response token against the trainer's packed forward + head over "
            "the same sequences (micro-batches of <= 16,384 tokens), one process, one set of weights. Ratios divide "
            "exact by fast. Cost targets: decode <= 1.3x, train step <= 1.25x. The H100 row is the latest code (the "
            "experts' decode tiles, one product per layer input, the GDN steps that skip idle rows); the H200 rows "
            "predate the fixed tiles.",
            exact_section(exact),
        ]
    if mtp:
        sections += [
            "## Speculative decoding with the MTP layer",
            "`benchmarks/mtp_bench.py`: the reduced Qwen3.5-MoE with 4 layers and one MTP layer (vocabulary 32,768), "
            "trained in fp32 on an order-1 Markov corpus of known entropy (next-token loss + 0.3 x the MTP loss), "
            "then served in bf16: prompts of 32 corpus tokens, 128 new tokens each at temperature 1. Plain = "
            "`GenerationEngine` (device graphs); speculative = `SpeculativeEngine` with k MTP drafts per round; "
            "each timed on its second batch, one process. Acceptance = drafts kept / drafted.",
            mtp_section(mtp),
        ]
    if rollout:
        sections += [
            "## Rollout: GRPO through verl's main_ppo with our engine and our rollout",
            "`recipe/tiny_cpu` with `platform=gpu_single` (trainer and rollout share one GPU) on the reduced "
            "Qwen3.5-MoE with 4 layers (`scripts/toy_rl.py --model-size reduced`), scripts/toy_rl.py's arith task, "
            "32 prompts x 8 samples per step, responses up to 256 tokens, fp32 master weights with bf16 compute, "
            "bf16 reference and rollout; our content-ordered replay buffer looking for a full batch every 0.1 s "
            "(verl's looks every 2 s). Step 1 includes the first Triton compiles and autotuning. "
            "`free_cache_engine=true` frees the rollout model, its decode slots and graphs at every sleep and "
            "builds them again each step; `false` keeps them resident across steps.",
            rollout_section(rollout),
        ]
    if ppo:
        sections += [
            "## PPO with a critic through verl's main_ppo",
            "`benchmarks/ppo.sh`: `recipe/tiny_cpu_ppo` with `platform=gpu_single` (actor, critic and our rollout "
            "share one GPU): our fsdp2 engine for the actor and for the critic (the actor's model spec with a value "
            "head, started from the actor's checkpoint), GAE, on the reduced Qwen3.5-MoE with 4 layers, "
            "scripts/toy_rl.py's arith task, 32 prompts x 8 samples per step, responses up to 256 tokens, bf16 "
            "compute over fp32 master weights, the rollout engine kept across steps. Step 1 includes the first "
            "Triton compiles and autotuning.",
            ppo_section(ppo),
        ]
    if align:
        sections += [
            "## Alignment",
            "`verl-moe align`: the same weights and batches through each backend; step-0 metrics and the last "
            "step of the K-step curves (docs/align.md reads them).",
        ]
        sections += [align_section(n, r) for n, r in align]
    return "\n\n".join(sections) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with BENCHMARKS.md instead of writing it")
    args = parser.parse_args()
    text = render(load())
    if args.check:
        if OUT.read_text() != text:
            print("BENCHMARKS.md is not what results/ gives: run python scripts/benchmarks_md.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
