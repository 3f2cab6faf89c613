"""The `verl-moe` command line: thin wrappers over `run(cfg) -> dict` in each tool module."""

from __future__ import annotations

import typer

app = typer.Typer(help="verl-moe: benchmarks and precision-alignment tools", no_args_is_help=True)


@app.command()
def bench(
    op: str = typer.Argument(..., help="op folder under verl_moe.ops, e.g. gdn, logprob"),
    case: list[str] = typer.Option([], help="case id(s) to run (default: all)"),
    provider: list[str] = typer.Option([], help="provider(s) to run (default: all)"),
    mode: list[str] = typer.Option([], help="fwd and/or fwd_bwd (default: both)"),
    reps: int = typer.Option(10, help="timed repetitions; the median is reported"),
    json_path: str = typer.Option(None, "--json", help="write the report JSON here"),
):
    """Time every provider of one op in one process, after a correctness check."""
    from .bench import BenchConfig, print_report, run

    report = run(
        BenchConfig(
            op=op,
            cases=tuple(case),
            providers=tuple(provider),
            modes=tuple(mode),
            reps=reps,
            json_path=json_path,
        )
    )
    print_report(report)
    if not all(r["check_ok"] for r in report["rows"]):
        raise typer.Exit(1)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
