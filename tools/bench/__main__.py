"""`python -m verl_moe.tools.bench <op> [--json PATH]`: `verl-moe bench <op>` without the CLI."""

import sys

from . import BenchConfig, print_report, run

args = sys.argv[1:]
json_path = args[args.index("--json") + 1] if "--json" in args else None
rep = run(BenchConfig(op=args[0], json_path=json_path))
print_report(rep)
sys.exit(0 if all(r["check_ok"] for r in rep["rows"]) else 1)
