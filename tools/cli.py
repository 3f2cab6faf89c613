"""The `verl-moe` command line: thin wrappers over `run(cfg) -> dict` in each tool module."""

from __future__ import annotations

import warnings

import typer

app = typer.Typer(help="verl-moe: benchmarks and precision-alignment tools", no_args_is_help=True)


@app.command()
def bench(
    op: str = typer.Argument(..., help="op folder under verl_moe.ops (gdn, logprob, ...) or model (a training step)"),
    case: list[str] = typer.Option([], help="case id(s) to run (default: all)"),
    provider: list[str] = typer.Option([], help="provider(s) to run (default: all)"),
    mode: list[str] = typer.Option([], help="fwd and/or fwd_bwd (default: both)"),
    reps: int = typer.Option(10, help="timed repetitions; the median is reported"),
    json_path: str = typer.Option(None, "--json", help="write the report JSON here"),
):
    """Time every provider of one op in one process, after a correctness check."""
    from .bench import BenchConfig, print_report, print_row, run

    report = run(
        BenchConfig(
            op=op,
            cases=tuple(case),
            providers=tuple(provider),
            modes=tuple(mode),
            reps=reps,
            json_path=json_path,
        ),
        on_row=print_row,
    )
    print_report(report)
    if not all(r["check_ok"] for r in report["rows"]):
        raise typer.Exit(1)


@app.command()
def align(
    preset: str = typer.Option(
        "tiny-qwen3.5-moe", help="model + stream preset (tiny-qwen3.5-moe, tiny-qwen3-moe, mid-qwen3-moe)"
    ),
    model: str = typer.Option(None, help="local HF folder to align instead of the preset's random weights"),
    backends: str = typer.Option(
        "reference,fsdp2",
        help="comma list; name[:dtype=..][:router=..][:world=..][:cfg.<field>=<json>]; the first is the golden",
    ),
    steps: int = typer.Option(5, help="K optimizer steps"),
    out: str = typer.Option("align_out", help="output folder (report.json, plots, traces)"),
    router_dtype: str = typer.Option(None, help="router dtype of every non-golden backend: bf16, fp32, fp64"),
    router_ablation: bool = typer.Option(False, help="run each non-golden backend with a bf16, fp32 and fp64 router"),
    tol: list[str] = typer.Option([], help="metric=value, overrides the default tolerance (repeatable)"),
    loss: str = typer.Option("grpo", help="grpo or gspo (verl's ppo_loss)"),
    seed: int = typer.Option(0, help="seed of the weights and of the batch stream"),
    batch_dump: str = typer.Option(None, help="verl batch dump to split into K mini-batches instead of the stream"),
    all_pairs: bool = typer.Option(False, help="also compare every two non-golden backends (e.g. fsdp2 vs megatron)"),
    jobs: int = typer.Option(1, help="backend workers run at a time (>1: they share the devices; wall times overlap)"),
):
    """Same weights, same RL batches through several backends: table, report.json, plots."""
    from .align import AlignConfig, print_report, run

    tolerances = []
    for item in tol:
        metric, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"--tol {item!r}: expected metric=value")
        tolerances.append((metric, float(value)))
    report = run(
        AlignConfig(
            preset=preset,
            model=model,
            backends=tuple(b for b in backends.split(",") if b),
            steps=steps,
            out=out,
            router_dtype=router_dtype,
            router_ablation=router_ablation,
            tolerances=tuple(tolerances),
            loss=loss,
            seed=seed,
            batch_dump=batch_dump,
            jobs=jobs,
            all_pairs=all_pairs,
        )
    )
    print_report(report)
    raise typer.Exit(report["exit_code"])


@app.command()
def curves(
    runs: list[str] = typer.Argument(
        ...,
        help="run logs: a verl .jsonl file or a folder (jsonl / TensorBoard), "
        "optionally label=path; the first is the baseline",
    ),
    metric: list[str] = typer.Option([], help="alias (reward, accuracy, grad_norm, entropy, kl) or logged key"),
    out: str = typer.Option("curves_out", help="folder for curves.png and curves.json"),
):
    """Plot metrics of several verl runs per step side by side, divergence marked."""
    from .curves import CurvesConfig, print_report, run

    cfg = CurvesConfig(runs=tuple(runs), out=out, **({"metrics": tuple(metric)} if metric else {}))
    print_report(run(cfg))


def main() -> None:
    # verl warns at import about every optional engine it lacks (torchtitan, megatron, ...); none of
    # them is used by these tools, so the warnings would only bury the report.
    warnings.filterwarnings("ignore", message=r".* engine is not available", category=UserWarning)
    # megatron-core (imported by verl when installed) warns that it falls back to torch without TE / Apex
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed", category=UserWarning)
    app()


if __name__ == "__main__":
    main()
