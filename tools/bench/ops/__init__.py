"""One bench module per op, named as the op's folder of `verl_moe.ops`: CASES, PROVIDERS, REFERENCE, MODES,
TOLERANCE, `unavailable`, `make_inputs`, `run` (`verl-moe bench <op>` finds every module here;
docs/benchmarking.md)."""
