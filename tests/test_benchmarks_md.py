"""BENCHMARKS.md is generated: `python scripts/benchmarks_md.py` must give it byte for byte from results/."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_benchmarks_md_is_generated_from_results():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "benchmarks_md.py"), "--check"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr + out.stdout
