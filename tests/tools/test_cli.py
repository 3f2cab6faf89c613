"""`verl-moe` errors and inputs: every usage error is one stderr line naming the problem, exit 2,
no traceback, raised before any work starts (no output folder, no worker); `--debug` keeps the
exception; a batch dump that needs unpickling is refused without `--trust-pickle`, before any of
its code runs; an align run that compares no pair is an error, never ALIGNED."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner
from verl_moe.tools import align
from verl_moe.tools.align import data
from verl_moe.tools.align.backends import parse_backend, unavailable
from verl_moe.tools.cli import USAGE_EXIT, app

MARKER_ENV = "VERL_MOE_TEST_MARKER"


class _WritesMarker:
    """Unpickling this calls a function of the pickle author's choice (here: create a file)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))  # any callable: open(path, "w") creates the marker


def _evil_pickle(tmp_path, name="evil.pkl"):
    marker = tmp_path / f"{name}.marker"
    path = tmp_path / name
    with open(path, "wb") as f:
        pickle.dump({"input_ids": _WritesMarker(str(marker))}, f)
    return path, marker


def _stream_batch(seed=3):
    (batch,) = data.make_stream(data.StreamSpec(num_prompts=2, group_size=2), vocab_size=64, steps=1, seed=seed)
    return {**batch, "old_log_probs": torch.randn(batch["responses"].shape, dtype=torch.float32)}


def _assert_one_line_usage_error(result, *needles):
    assert result.exit_code == USAGE_EXIT, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert ": error: " in lines[0], lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert result.stdout == "" and "Traceback" not in result.output


# ---- batch dumps -----------------------------------------------------------------------------------


def test_pickled_dump_is_refused_before_its_code_runs(tmp_path):
    path, marker = _evil_pickle(tmp_path)
    with pytest.raises(ValueError, match="--trust-pickle"):
        data.load_batch_dump(path, steps=1)
    zipped = tmp_path / "evil.pt"  # torch.save of an object: the zip branch of the same check
    zipped_marker = tmp_path / "evil.pt.marker"
    torch.save({"input_ids": _WritesMarker(str(zipped_marker))}, zipped)
    with pytest.raises(ValueError, match="--trust-pickle"):
        data.load_batch_dump(zipped, steps=1)
    assert not marker.exists() and not zipped_marker.exists()
    # the same file with the flag is unpickled: the marker appears (the refusal above was the guard)
    with pytest.raises(ValueError):
        data.load_batch_dump(path, steps=1, trust_pickle=True)  # no BATCH_KEYS in it
    assert marker.exists()


@pytest.mark.usefixtures("needs_verl")
def test_safe_dumps_load_without_the_flag_and_a_dataproto_needs_it(tmp_path):
    from verl import DataProto

    batch = _stream_batch()
    safe = data.save_batch_dump(batch, tmp_path / "dump.safetensors")
    torch.save(batch, tmp_path / "dict.pt")
    DataProto.from_single_dict(batch).save_to_disk(tmp_path / "dataproto.pkl")
    for path, trust in ((safe, False), (tmp_path / "dict.pt", False), (tmp_path / "dataproto.pkl", True)):
        halves = data.load_batch_dump(path, steps=2, trust_pickle=trust)
        assert len(halves) == 2 and set(halves[0]) == {*data.BATCH_KEYS, "old_log_probs"}
        for key, value in batch.items():
            joined = torch.cat([h[key] for h in halves])
            assert joined.dtype == value.dtype and torch.equal(joined, value), (path.name, key)
    with pytest.raises(ValueError, match="trust-pickle"):
        data.load_batch_dump(tmp_path / "dataproto.pkl", steps=2)
    with pytest.raises(ValueError, match="equal mini-batches"):
        data.load_batch_dump(safe, steps=3)
    short = {**batch, "advantages": batch["advantages"][:1]}
    with pytest.raises(ValueError, match="different numbers of sequences"):
        data.load_batch_dump(data.save_batch_dump(short, tmp_path / "short.safetensors"), steps=1)
    (tmp_path / "junk.bin").write_bytes(b"not a dump at all")
    with pytest.raises(ValueError, match="junk.bin"):
        data.load_batch_dump(tmp_path / "junk.bin", steps=1)


# ---- usage errors through the command line ---------------------------------------------------------


def _usage_cases(tmp_path):
    truncated = tmp_path / "run.jsonl"
    truncated.write_text('{"step": 0, "data": {"actor/grad_norm": 1.0}}\n{"step": 1, "data": {"actor/gr\n')
    missing = str(tmp_path / "missing")
    batch = _stream_batch()
    vocab = data.get_preset("tiny-qwen3.5-moe").config["vocab_size"]
    batch["input_ids"][0, -1] = vocab  # one id past the tiny preset's vocabulary
    past_vocab = data.save_batch_dump(batch, tmp_path / "past_vocab.safetensors")
    return [
        (
            ["align", "--batch-dump", str(past_vocab), "--steps", "1"],
            [f"token id {vocab} >= the model's vocab_size {vocab}"],
        ),
        (["align", "--model", missing], [missing]),
        (["align", "--batch-dump", missing], [missing]),
        (["align", "--backends", "reference,nope"], ["unknown backend 'nope'"]),
        (["align", "--preset", "nope"], ["unknown preset 'nope'"]),
        (["align", "--steps", "0"], ["steps must be >= 1"]),
        (["align", "--steps", "abc"], ["'--steps'"]),
        (["align", "--tol", "logp_abs_diff_mean=abc"], ["'--tol'", "'abc' is not a number"]),
        (["align", "--tol", "logp_abs_diff_mean=nan"], ["logp_abs_diff_mean=nan"]),
        (["align", "--tol", "logp_mean=1"], ["unknown tolerance metric 'logp_mean'"]),
        (["align", "--backends", "reference"], ["nothing to compare"]),
        (["align", "--backends", "reference,reference"], ["nothing to compare"]),
        (["curves", missing], [missing]),
        (["curves", str(truncated)], [f"{truncated}:2", "not a verl JSONL line"]),
        (["curves", f"a={truncated}", f"a={truncated}"], ["run labels repeat"]),
        (["bench", "nope"], ["unknown bench op 'nope'"]),
        (["bench", "logprob", "--case", "nope"], ["unknown cases ['nope']"]),
        (["bench", "logprob", "--provider", "nope"], ["unknown providers ['nope']"]),
        (["bench", "logprob", "--mode", "bwd"], ["unknown modes ['bwd']"]),
        (["nope"], ["No such command 'nope'"]),
    ]


@pytest.mark.usefixtures("needs_verl")
def test_usage_errors_are_one_line_exit_2_before_any_work(tmp_path):
    runner = CliRunner()
    for args, needles in _usage_cases(tmp_path):
        out = tmp_path / "out"
        extra = ["--out", str(out)] if args[0] in ("align", "curves") else []
        result = runner.invoke(app, [*args, *extra])
        _assert_one_line_usage_error(result, *needles)
        assert not out.exists(), args  # failed before writing anything


def test_align_with_megatron_skipped_compares_nothing_and_fails(tmp_path):
    reason = unavailable(parse_backend("megatron"))
    if reason is None:
        pytest.skip("megatron runs here: reference,megatron is a real comparison")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["align", "--backends", "reference,megatron", "--out", str(out)])
    _assert_one_line_usage_error(result, "nothing to compare", "megatron skipped")
    assert not out.exists()
    with pytest.raises(ValueError, match="nothing to compare"):
        align.run(align.AlignConfig(backends=("reference", "megatron"), out=str(out), progress=False))


def test_debug_keeps_the_exception_and_a_refused_pickle_is_one_line(tmp_path):
    result = CliRunner().invoke(app, ["--debug", "align", "--steps", "0"])
    assert isinstance(result.exception, ValueError) and "steps must be >= 1" in str(result.exception)
    assert result.exit_code != 0
    path, marker = _evil_pickle(tmp_path)
    result = CliRunner().invoke(app, ["align", "--batch-dump", str(path), "--out", str(tmp_path / "out")])
    _assert_one_line_usage_error(result, str(path), "--trust-pickle")
    assert not marker.exists()


def test_installed_command_prints_one_line_and_no_traceback(tmp_path):
    """The console script itself (its warning filters, typer's exception hook), in fresh processes."""
    path, marker = _evil_pickle(tmp_path)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-c", "from verl_moe.tools.cli import main; main()"]
    args = ["align", "--batch-dump", str(path), "--out", str(tmp_path / "out")]
    proc = subprocess.run([*command, *args], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == USAGE_EXIT, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--trust-pickle" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not marker.exists() and not (tmp_path / "out").exists()
    proc = subprocess.run([*command, "--debug", "bench", "nope"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "unknown bench op" in proc.stderr
