"""The bench runner: correctness check before timing, per-output errors, ratios, JSON report."""

import json
from pathlib import Path

import pytest
import torch
from verl_moe.tools import bench
from verl_moe.tools.bench.ops import logprob as logprob_bench

TINY = {"id": "N24-D16-V40", "n": 24, "d": 16, "vocab": 40, "dtype": "float32"}
PROVIDERS = ("ours-torch-chunked", "naive", "verl_chunked")


@pytest.fixture
def tiny_logprob(monkeypatch):
    monkeypatch.setattr(logprob_bench, "CASES", [TINY])


def test_runner_checks_times_and_reports(tiny_logprob, tmp_path):
    out = tmp_path / "report.json"
    cfg = bench.BenchConfig(op="logprob", providers=PROVIDERS, warmup=1, reps=2, json_path=str(out))
    report = bench.run(cfg)
    assert json.dumps(json.loads(out.read_text())) == json.dumps(report)  # NaN-safe equality
    rows = {(r["mode"], r["provider"]): r for r in report["rows"]}
    assert set(rows) == {(m, p) for m in ("fwd", "fwd_bwd") for p in PROVIDERS}
    for (mode, provider), row in rows.items():
        assert row["check_ok"], row
        assert row["ms"] > 0
        # fwd: log_prob, entropy; fwd_bwd adds d_hidden and d_weight, each checked on its own.
        assert len(row["rel_rms_per_output"]) == (2 if mode == "fwd" else 4)
        assert row["rel_rms_vs_ref"] == max(row["rel_rms_per_output"])
        if provider == "naive":
            assert row["rel_rms_vs_ref"] == 0.0
        assert row["ratio_ours-torch-chunked_over_this"] == pytest.approx(rows[(mode, PROVIDERS[0])]["ms"] / row["ms"])


def test_runner_flags_a_wrong_provider(tiny_logprob, monkeypatch):
    real_run = logprob_bench.run

    def perturbed(provider, inputs, mode):
        outs = real_run(provider, inputs, mode)
        if provider == "ours-torch-chunked":
            outs[0] = outs[0] * 1.05  # a 5% error in log_prob only
        return outs

    monkeypatch.setattr(logprob_bench, "run", perturbed)
    report = bench.run(bench.BenchConfig(op="logprob", providers=PROVIDERS[:2], modes=("fwd",), warmup=1, reps=1))
    row = next(r for r in report["rows"] if r["provider"] == "ours-torch-chunked")
    assert not row["check_ok"]
    assert row["rel_rms_per_output"][0] > logprob_bench.TOLERANCE["ours-torch-chunked"]
    assert row["rel_rms_per_output"][1] < 1e-5  # entropy untouched: the error is attributed per output


def test_runner_rejects_unknown_names(tiny_logprob):
    with pytest.raises(ValueError, match="unknown providers"):
        bench.run(bench.BenchConfig(op="logprob", providers=("nope",)))
    with pytest.raises(ValueError, match="unknown cases"):
        bench.run(bench.BenchConfig(op="logprob", cases=(TINY["id"], "N1")))  # one typo is not dropped silently


def test_unavailable_provider_is_skipped_with_its_reason(tiny_logprob):
    if torch.cuda.is_available():
        pytest.skip("liger may run on cuda")
    report = bench.run(bench.BenchConfig(op="logprob", providers=("naive", "liger"), modes=("fwd",), reps=1))
    assert "liger" in report["skipped_providers"]
    assert {r["provider"] for r in report["rows"]} == {"naive"}


def test_rows_stream_out_and_a_case_that_does_not_fit_becomes_rows(monkeypatch, tmp_path):
    """Each row reaches `on_row` when measured and the JSON is rewritten as the run goes; a case whose
    inputs run out of memory becomes one row per provider saying so (with the allocation asked for), and
    the cases after it still run."""
    broken = {**TINY, "id": "broken"}
    after = {**TINY, "id": "after"}
    real_make_inputs = logprob_bench.make_inputs

    def make_inputs(case, dev):
        if case["id"] == "broken":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 15.00 GiB. GPU 0 has 2 GiB free")
        return real_make_inputs(case, dev)

    monkeypatch.setattr(logprob_bench, "CASES", [TINY, broken, after])
    monkeypatch.setattr(logprob_bench, "make_inputs", make_inputs)
    out, seen, started = tmp_path / "report.json", [], []
    cfg = bench.BenchConfig(op="logprob", providers=PROVIDERS[:2], warmup=1, reps=1, json_path=str(out))
    report = bench.run(cfg, on_row=seen.append, on_start=lambda *key: started.append(key))
    on_disk = json.loads(out.read_text())["rows"]
    expected = [
        (c, m, p) for c in ("N24-D16-V40", "broken", "after") for m in ("fwd", "fwd_bwd") for p in PROVIDERS[:2]
    ]
    assert started == expected
    assert [(r["case"], r["mode"], r["provider"]) for r in seen] == expected
    assert [(r["case"], r["mode"], r["provider"]) for r in on_disk] == expected
    for row in report["rows"]:
        if row["case"] == "broken":
            assert row["error"].startswith("OutOfMemoryError: CUDA out of memory") and row["asked_gib"] == 15.0
            assert row["check_ok"] and row["ms"] != row["ms"]  # not run, not a failed check
        else:
            assert "error" not in row and row["check_ok"] and row["ms"] > 0


def test_a_provider_that_fails_becomes_a_row_and_the_others_run(tiny_logprob, monkeypatch):
    """A provider out of memory is a row with the GiB it asked for; one failing otherwise is a row that fails
    the check; the reference failing leaves the others timed without a check."""
    real_run = logprob_bench.run

    def run(provider, inputs, mode):
        if provider == "verl_chunked":
            raise torch.OutOfMemoryError("Tried to allocate 512.00 MiB")
        if provider == "naive" and mode == "fwd_bwd":
            raise ValueError("a bug")
        return real_run(provider, inputs, mode)

    monkeypatch.setattr(logprob_bench, "run", run)
    report = bench.run(bench.BenchConfig(op="logprob", providers=PROVIDERS, warmup=1, reps=1))
    rows = {(r["mode"], r["provider"]): r for r in report["rows"]}
    assert set(rows) == {(m, p) for m in ("fwd", "fwd_bwd") for p in PROVIDERS}
    assert all(
        rows[(m, "verl_chunked")]["asked_gib"] == 0.5 and rows[(m, "verl_chunked")]["check_ok"]
        for m in ("fwd", "fwd_bwd")
    )
    assert rows[("fwd_bwd", "naive")]["error"] == "ValueError: a bug" and not rows[("fwd_bwd", "naive")]["check_ok"]
    ours = rows[("fwd_bwd", "ours-torch-chunked")]
    assert ours["check_ok"] and ours["ms"] > 0 and ours["rel_rms_per_output"] == []  # no reference to check against
    assert rows[("fwd", "ours-torch-chunked")]["rel_rms_per_output"]  # checked where the reference ran
    busy = ours["kernel_ms"] / ours["ms"]  # kernel time is measured on accelerators only (NaN on cpu)
    assert ours["busy_share"] == busy or (busy != busy and ours["busy_share"] != ours["busy_share"])


def test_a_report_that_fails_to_write_leaves_the_previous_one_whole(tmp_path):
    """A write that fails midway (here a value JSON cannot hold, after some of the file is out) keeps
    the last whole report and leaves no partial file beside it."""
    out = tmp_path / "report.json"
    bench.write_report({"rows": [1, 2]}, str(out))
    with pytest.raises(TypeError):
        bench.write_report({"rows": [3], "late": object()}, str(out))
    assert json.loads(out.read_text()) == {"rows": [1, 2]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_a_case_is_freed_before_the_next_one_allocates(monkeypatch):
    """When a (case, mode)'s inputs are made, nothing holds the previous one's any more (on a GPU, a
    model bench's next case would otherwise run beside the last one's models)."""
    import gc
    import weakref

    real_make_inputs = logprob_bench.make_inputs
    made = []

    def make_inputs(case, dev):
        gc.collect()
        assert all(ref() is None for ref in made), "the previous case's inputs are still referenced"
        inputs = real_make_inputs(case, dev)
        made.append(weakref.ref(inputs["hidden"]))
        return inputs

    monkeypatch.setattr(logprob_bench, "CASES", [TINY, {**TINY, "id": "second"}])
    monkeypatch.setattr(logprob_bench, "make_inputs", make_inputs)
    bench.run(bench.BenchConfig(op="logprob", providers=PROVIDERS[:2], warmup=1, reps=1))
    assert len(made) == 4  # two cases x two modes


def test_source_sha_names_the_code_not_its_location(tmp_path):
    from verl_moe.tools.provenance import PACKAGE_PARTS, source_sha

    def tree(base, body):
        (base / "ops" / "__pycache__").mkdir(parents=True)
        (base / "ops" / "k.py").write_text(body)
        (base / "ops" / "__pycache__" / "k.cpython-311.pyc").write_bytes(base.name.encode())
        (base / "configs").mkdir()
        (base / "configs" / "c.yaml").write_text("a: 1\n")
        return [base / "ops", base / "configs"]

    a = tree(tmp_path / "a", "x = 1\n")
    b = tree(tmp_path / "b", "x = 1\n")
    c = tree(tmp_path / "c", "x = 2\n")
    assert source_sha(a) == source_sha(b) != source_sha(c)  # location and bytecode caches do not count
    (tmp_path / "b" / "ops" / "k.py").rename(tmp_path / "b" / "ops" / "j.py")
    assert source_sha(b) != source_sha(a)  # file names count
    import verl_moe.ops

    # the installed package: its subpackages side by side (the editable install maps them from one folder)
    base = Path(verl_moe.ops.__file__).parent.parent
    assert source_sha() == source_sha([base / part for part in PACKAGE_PARTS])


@pytest.mark.gpu
def test_kernel_time_counts_device_work_only():
    """kernel_ms sums the kernels of a call: for a call that runs one GEMM it is close to the GEMM
    alone timed by CUDA events, and no larger than the call's synchronised wall time."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    call = lambda: a @ a  # noqa: E731
    for _ in range(3):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        call()
    end.record()
    torch.cuda.synchronize()
    event_ms = start.elapsed_time(end) / 10
    kms = bench.kernel_ms(call, 5)
    assert 0.5 * event_ms < kms < 1.5 * event_ms
    assert kms <= bench.time_ms(call, 5) * 1.05


def test_kernel_time_is_nan_off_cuda():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU path")
    assert bench.kernel_ms(lambda: torch.ones(3) + 1, 2) != bench.kernel_ms(lambda: None, 1)  # NaN != NaN


def test_reports_name_the_ops_selection_they_ran_with(monkeypatch):
    from verl_moe.tools.provenance import environment

    monkeypatch.delenv("VERL_MOE_OPS", raising=False)
    assert "env" not in environment()
    monkeypatch.setenv("VERL_MOE_OPS", "attention.decode=triton")
    assert environment()["env"] == {"VERL_MOE_OPS": "attention.decode=triton"}
