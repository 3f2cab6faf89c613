"""`verl-moe align`: the same HF weights and the same RL batches through several backends, compared
pair by pair (what is written: `runner.py`'s docstring).

config.py (AlignConfig, tolerances) -> runner.py (the run) -> backends/ (one table; reference,
engine, megatron), each backend's steps recorded by trace.py's one loop -> metrics.py (pairs) ->
report.py (report.json schema, plots, table). data.py: presets, the batch stream, batch dumps;
launch.py: in-process or torchrun workers; job.py: what one backend run gets.
"""

from __future__ import annotations

from .config import DEFAULT_TOLERANCES, AlignConfig, expand_backends
from .report import REPORT_SCHEMA, SCHEMA_VERSION, print_report, validate_report
from .runner import run

__all__ = [
    "DEFAULT_TOLERANCES",
    "REPORT_SCHEMA",
    "SCHEMA_VERSION",
    "AlignConfig",
    "expand_backends",
    "print_report",
    "run",
    "validate_report",
]
