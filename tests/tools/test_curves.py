"""`verl-moe curves` on logs written in the test by verl's own file logger and by TensorBoard."""

from __future__ import annotations

import json
import math

import pytest
from verl_moe.tools import curves

STEPS = 40
BREAK = 22  # the step where the "unstable" run starts to differ


def _metrics(step: int, unstable: bool) -> dict[str, float]:
    reward = 0.2 + 0.5 * (1 - math.exp(-step / 15))
    grad_norm = 0.8 + 0.05 * math.sin(step)
    if unstable and step >= BREAK:
        reward -= 0.04 * (step - BREAK + 1)
        grad_norm *= 1 + 0.5 * (step - BREAK + 1)
    return {"critic/score/mean": reward, "actor/grad_norm": grad_norm, "actor/entropy": 1.0 - 0.01 * step}


def _write_jsonl(path, unstable: bool, monkeypatch):
    from verl.utils.tracking import FileLogger

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    logger = FileLogger("proj", "exp")
    for s in range(STEPS):
        logger.log(_metrics(s, unstable), step=s)
    logger.finish()


def _write_tensorboard(folder, unstable: bool):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder))
    for s in range(STEPS):
        for key, value in _metrics(s, unstable).items():
            writer.add_scalar(key, value, s)
    writer.close()


@pytest.fixture
def runs(tmp_path, monkeypatch, needs_verl):
    _write_jsonl(tmp_path / "megatron.jsonl", unstable=False, monkeypatch=monkeypatch)
    _write_tensorboard(tmp_path / "fsdp_tb", unstable=True)
    _write_tensorboard(tmp_path / "same_tb", unstable=False)
    return tmp_path


def test_readers_agree_on_the_logged_values(runs):
    from_jsonl = curves.read_run(runs / "megatron.jsonl")
    from_tb = curves.read_run(runs / "same_tb")
    assert set(from_jsonl) == set(from_tb) == {"critic/score/mean", "actor/grad_norm", "actor/entropy"}
    for key in from_jsonl:
        assert sorted(from_jsonl[key]) == list(range(STEPS))
        for s, v in from_jsonl[key].items():
            assert from_tb[key][s] == pytest.approx(v, rel=1e-6)  # TensorBoard stores fp32


def test_curves_marks_the_divergent_run_only(runs):
    cfg = curves.CurvesConfig(
        runs=(f"megatron={runs / 'megatron.jsonl'}", f"fsdp={runs / 'fsdp_tb'}", f"same={runs / 'same_tb'}"),
        metrics=("reward", "grad_norm", "kl", "actor/entropy"),
        out=str(runs / "out"),
    )
    report = curves.run(cfg)
    by_metric = {m["metric"]: m for m in report["metrics"]}
    assert "kl" not in by_metric  # logged by no run: left out, not an error
    assert by_metric["reward"]["keys"]["fsdp"] == "critic/score/mean"
    for metric in ("reward", "grad_norm"):
        step = by_metric[metric]["divergence_step"]["fsdp"]
        assert step is not None and BREAK <= step <= BREAK + cfg.smooth + cfg.patience, (metric, step)
        assert by_metric[metric]["divergence_step"]["same"] is None
    assert by_metric["actor/entropy"]["divergence_step"]["fsdp"] is None
    png = runs / "out" / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    on_disk = json.loads((runs / "out" / "curves.json").read_text())
    assert on_disk["metrics"] == report["metrics"]
    assert on_disk["git_sha"] == report["git_sha"] and "torch" in on_disk["versions"]


def test_curves_fails_loudly_without_any_metric(runs):
    with pytest.raises(ValueError, match="none of"):
        curves.run(
            curves.CurvesConfig(runs=(str(runs / "megatron.jsonl"),), metrics=("accuracy",), out=str(runs / "o2"))
        )
    with pytest.raises(FileNotFoundError):
        curves.read_run(runs / "missing")
