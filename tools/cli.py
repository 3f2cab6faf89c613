"""The `verl-moe` command line: thin wrappers over `run(cfg) -> dict` in each tool module.

Exit codes: 0 success (bench: every check passed; align: ALIGNED); 1 a result that fails its gate
(a bench check, an align tolerance, a failed backend); 2 a usage error: a bad option, a missing path,
an unknown name, an unreadable input, nothing to compare. A usage error is one line on stderr, never
a traceback: every `run(cfg)` checks its inputs (raising ValueError / FileNotFoundError) before it
starts any work, and `_Group.main` below turns those and click's usage errors into that line.
`verl-moe --debug ...` lets them propagate with their traceback.
"""

from __future__ import annotations

import contextlib
import json
import sys
import warnings

import typer
from typer.core import TyperGroup

try:  # typer >= 0.2x raises the exceptions of its vendored click
    from typer._click import exceptions as click_errors
except ImportError:
    from click import exceptions as click_errors

# Raised by the tools' input checks. A ValueError from deeper inside a run reads the same; `--debug` shows where.
USAGE_ERRORS = (ValueError, FileNotFoundError)
USAGE_EXIT = 2


def _one_line(text: str) -> str:
    return "; ".join(line.strip() for line in str(text).splitlines() if line.strip())


class _Group(TyperGroup):
    """The command group: usage errors become one stderr line and exit 2 (see the module docstring)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        argv = list(sys.argv[1:] if args is None else args)
        prog = prog_name or "verl-moe"
        global_options = argv[: next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))]
        debug = "--debug" in global_options
        try:
            rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
        except click_errors.NoArgsIsHelpError as e:  # bare `verl-moe`: the help (already printed) is the answer
            code = e.exit_code
        except click_errors.ClickException as e:  # bad option / argument, unknown command
            if debug:
                raise
            where = e.ctx.command_path if getattr(e, "ctx", None) else prog
            typer.echo(f"{where}: error: {_one_line(e.format_message())}", err=True)
            code = e.exit_code
        except typer.Abort:
            typer.echo("Aborted!", err=True)
            code = 1
        except USAGE_ERRORS as e:
            if debug:
                raise
            command = next((a for a in argv if a in self.commands), None)
            where = f"{prog} {command}" if command else prog
            typer.echo(f"{where}: error: {_one_line(e) or type(e).__name__}", err=True)
            code = USAGE_EXIT
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(help="verl-moe: benchmarks and precision-alignment tools", no_args_is_help=True, cls=_Group)


@app.callback()
def _options(
    debug: bool = typer.Option(
        False, "--debug", help="show the traceback of an error instead of one line on stderr (give before the command)"
    ),
):
    # read by _Group.main from the command line itself, so it also covers errors in parsing the command's options
    del debug


@app.command()
def bench(
    op: str = typer.Argument(
        ...,
        help="op folder under verl_moe.ops (gdn, logprob, ...), model (a training step), rollout (decoding), "
        "exact (exact mode against fast mode: rollout vs trainer log-probs, decode and train step), "
        "veomni / transformers (our kernels inside those projects' models)",
    ),
    case: list[str] = typer.Option(
        [], help="case id(s) to run (default: all); rollout: uniform (fixed lengths) and/or rl (RL-shaped batches)"
    ),
    provider: list[str] = typer.Option([], help="provider(s) to run (default: all)"),
    mode: list[str] = typer.Option([], help="fwd and/or fwd_bwd (default: both)"),
    reps: int = typer.Option(10, help="timed repetitions; the median is reported"),
    json_path: str = typer.Option(None, "--json", help="write the report JSON here"),
    offload: bool = typer.Option(
        False, "--offload", help="model only: activation offload of ours (decoder layers' saved tensors to host)"
    ),
    checkpoint_units: str = typer.Option(
        None, help="model only, -ckpt cases: 'layer' or 'tiles' (default: tiles with --offload, as the engines)"
    ),
    tile_tokens: int = typer.Option(None, help="model only: the checkpoint tile in tokens (default 16384)"),
    batch: int = typer.Option(256, help="rollout: sequences decoded at once; exact: requests"),
    prompt_len: int = typer.Option(128, help="rollout only: tokens per prompt"),
    new_tokens: int = typer.Option(256, help="rollout only: tokens generated per sequence"),
    layers: int = typer.Option(4, help="rollout, exact: decoder layers of the reduced Qwen3.5-MoE"),
):
    """Time every provider of one op in one process, after a correctness check (`rollout`: our
    rollout engine's decode against transformers' generate, docs/rollout.md)."""
    if op in ("rollout", "exact"):
        from .bench import exact as exact_bench
        from .bench import rollout as rollout_bench
        from .bench import write_report
        from .provenance import environment

        def on_record(records: list[dict]) -> None:
            print(json.dumps(records[-1]), flush=True)
            if json_path:  # rewritten after each provider: a run cut short keeps what it measured
                report = {"tool": "bench", "op": op, "argv": sys.argv, **environment(), "records": records}
                write_report(report, json_path)

        if op == "exact":
            records = exact_bench.run(batch, layers, on_record=on_record)
        else:
            providers = tuple(provider) or rollout_bench.PROVIDERS
            cases = tuple(case) or rollout_bench.CASES
            unknown = sorted(set(cases) - set(rollout_bench.CASES))
            if unknown:
                raise typer.BadParameter(f"unknown rollout case(s) {unknown}; choices: {list(rollout_bench.CASES)}")
            records = []

            def add(new: list[dict]) -> None:
                on_record([*records, *new])

            if "uniform" in cases:
                records += rollout_bench.run(batch, prompt_len, new_tokens, layers, providers, add)
            if "rl" in cases:
                records += rollout_bench.run_rl(batch, layers, providers, add)
        if any("error" in r for r in records):
            raise typer.Exit(1)
        return
    from rich.console import Console

    from .bench import BenchConfig, print_report, print_row, run

    config = BenchConfig(
        op=op,
        cases=tuple(case),
        providers=tuple(provider),
        modes=tuple(mode),
        reps=reps,
        json_path=json_path,
        extra={
            **({"offload": True} if offload else {}),
            **({"checkpoint_units": checkpoint_units} if checkpoint_units else {}),
            **({"tile_tokens": tile_tokens} if tile_tokens else {}),
        },
    )
    console = Console(stderr=True)
    # what runs now: a live status line on a terminal, one line per start in logs (device runs, CI)
    with console.status(f"bench {op}", spinner="dots") if console.is_terminal else contextlib.nullcontext() as live:

        def on_start(case_id: str, mode_id: str, provider_id: str) -> None:
            text = f"bench {op}: {case_id} {mode_id} {provider_id}"
            if live is not None:
                live.update(text)
            else:
                print(text, file=sys.stderr, flush=True)

        report = run(config, on_row=print_row, on_start=on_start)
    print_report(report)
    if not all(r["check_ok"] for r in report["rows"]):
        raise typer.Exit(1)


@app.command()
def align(
    preset: str = typer.Option(
        "tiny-qwen3.5-moe",
        help="model + stream preset (tiny-qwen3.5-moe, tiny-qwen3-moe, mid-qwen3-moe, mid-qwen3.5-moe)",
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
    router_replay: str = typer.Option(
        None,
        help="R2: every backend replays its own θ0 routes of each batch in each update; R3: the fp64 reference's θ0 "
        "routes (the rollout's stand-in); megatron stays free (per backend: name:replay=R2)",
    ),
    tol: list[str] = typer.Option([], help="metric=value, overrides the default tolerance (repeatable)"),
    loss: str = typer.Option("grpo", help="grpo or gspo (verl's ppo_loss)"),
    seed: int = typer.Option(0, help="seed of the weights and of the batch stream"),
    batch_dump: str = typer.Option(
        None,
        help="verl batch dump to split into K mini-batches instead of the stream: safetensors or a torch file "
        "of tensors (a pickled DataProto needs --trust-pickle)",
    ),
    trust_pickle: bool = typer.Option(
        False,
        help="allow a --batch-dump that is a pickle (verl's DataProto.save_to_disk, a torch-saved TensorDict): "
        "unpickling runs code stored in the file, so give it only for a dump you made or trust",
    ),
    all_pairs: bool = typer.Option(False, help="also compare every two non-golden backends (e.g. fsdp2 vs megatron)"),
    jobs: int = typer.Option(1, help="backend workers run at a time (>1: they share the devices; wall times overlap)"),
):
    """Same weights, same RL batches through several backends: table, report.json, plots."""
    from .align import AlignConfig, print_report, run

    tolerances = []
    for item in tol:
        metric, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"{item!r}: expected metric=value", param_hint="'--tol'")
        try:
            tolerances.append((metric, float(value)))
        except ValueError:
            raise typer.BadParameter(f"{item!r}: {value!r} is not a number", param_hint="'--tol'") from None
    report = run(
        AlignConfig(
            preset=preset,
            model=model,
            backends=tuple(b for b in backends.split(",") if b),
            steps=steps,
            out=out,
            router_dtype=router_dtype,
            router_ablation=router_ablation,
            router_replay=router_replay,
            tolerances=tuple(tolerances),
            loss=loss,
            seed=seed,
            batch_dump=batch_dump,
            trust_pickle=trust_pickle,
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
