"""The rich table every tool prints (bench, align, curves)."""

from __future__ import annotations

import sys


def _fmt(value) -> str:
    if isinstance(value, float):
        if value != value:
            return "-"
        return f"{value:.4g}"
    return str(value)


def render_table(title: str, columns: list[str], rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(c)
    for row in rows:
        table.add_row(*(_fmt(row.get(c, "")) for c in columns))
    # Off a terminal (CI logs, device runs) rich would squeeze columns to 80 characters.
    Console(width=None if sys.stdout.isatty() else 240).print(table)
