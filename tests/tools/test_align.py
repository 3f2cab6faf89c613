"""`verl-moe align`: metrics against independent fp64 computations, the report schema, the
perturbed-backend gate, and reference vs fsdp2 (2 gloo ranks) on the tiny preset.

Tolerances of the tool itself live in `verl_moe.tools.align.DEFAULT_TOLERANCES`; these tests only
compare the tool with independent computations (1e-12 relative: both sides are fp64).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from verl_moe.tools import align
from verl_moe.tools.align import data, metrics
from verl_moe.tools.align.backends import parse_backend
from verl_moe.tools.align.trace import BackendTrace, Probe, StepTrace, param_group

FP64_REL = 1e-12
PERTURBED = "reference:cfg.rope_parameters.partial_rotary_factor=0.5"  # a wrong rotary dim


# ---- metrics on synthetic tensors --------------------------------------------------------------


def _trace(seed: int, base: BackendTrace | None = None, noise: float = 1e-3) -> BackendTrace:
    g = torch.Generator().manual_seed(seed)

    def near(t):
        return t + noise * torch.randn(t.shape, generator=g, dtype=torch.float64)

    if base is None:
        logp = -torch.rand(50, generator=g, dtype=torch.float64) * 5
        step = StepTrace(
            log_probs=logp,
            entropy=torch.rand(50, generator=g, dtype=torch.float64),
            loss=0.3,
            grad_norm=2.0,
            grads={
                "router": torch.randn(40, generator=g, dtype=torch.float64),
                "experts": torch.randn(90, generator=g),
            },
            params={
                "router": torch.randn(40, generator=g, dtype=torch.float64),
                "experts": torch.randn(90, generator=g),
            },
            topk=[torch.randint(0, 8, (30, 2), generator=g) for _ in range(3)],
        )
        p0 = {k: v + 0.1 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in step.params.items()}
        return BackendTrace("a", {"dtype": "fp64"}, params0=p0, steps=[step])
    s = base.steps[0]
    topk = [t.clone() for t in s.topk]
    topk[1][:5, 0] = (topk[1][:5, 0] + 1) % 8  # may collide with the other slot: counted by set below
    step = StepTrace(
        log_probs=near(s.log_probs),
        entropy=near(s.entropy),
        loss=s.loss + 1e-4,
        grad_norm=2.1,
        grads={k: near(v.double()) for k, v in s.grads.items()},
        params={k: near(v.double()) for k, v in s.params.items()},
        topk=topk,
    )
    return BackendTrace("b", {"dtype": "fp32"}, params0=base.params0, steps=[step])


def test_step_metrics_match_independent_fp64():
    a = _trace(0)
    b = _trace(1, base=a)
    m = metrics.step_metrics(a.steps[0], b.steps[0], a.params0)
    la, lb = a.steps[0].log_probs.tolist(), b.steps[0].log_probs.tolist()
    diffs = [abs(x - y) for x, y in zip(la, lb)]
    assert m["logp_abs_diff_mean"] == pytest.approx(sum(diffs) / len(diffs), rel=FP64_REL)
    assert m["logp_abs_diff_max"] == pytest.approx(max(diffs), rel=FP64_REL)
    k3 = [math.exp(x - y) - 1 - (x - y) for x, y in zip(la, lb)]
    assert m["kl_k3_mean"] == pytest.approx(sum(k3) / len(k3), rel=1e-9)
    ea, eb = a.steps[0].entropy.numpy(), b.steps[0].entropy.numpy()
    assert m["entropy_abs_diff_mean"] == pytest.approx(np.abs(ea - eb).mean(), rel=FP64_REL)
    assert m["loss_abs_diff"] == pytest.approx(1e-4, rel=1e-9)
    assert m["grad_norm_rel_diff"] == pytest.approx(0.1 / 2.0, rel=FP64_REL)
    for group in ("router", "experts"):
        x, y = a.steps[0].grads[group].double().numpy(), b.steps[0].grads[group].numpy()
        assert m["grad_cosine"][group] == pytest.approx(x @ y / np.sqrt((x @ x) * (y @ y)), rel=FP64_REL)
    assert m["grad_cosine_min"] == min(m["grad_cosine"].values())
    flips = total = 0
    for ta, tb in zip(a.steps[0].topk, b.steps[0].topk):
        for ra, rb in zip(ta.tolist(), tb.tolist()):
            flips += set(ra) != set(rb)
            total += 1
    assert 0 < flips and m["router_flip_rate"] == pytest.approx(flips / total, rel=FP64_REL)
    pa = np.concatenate([a.steps[0].params[g].double().numpy() for g in ("router", "experts")])
    pb = np.concatenate([b.steps[0].params[g].double().numpy() for g in ("router", "experts")])
    p0 = np.concatenate([a.params0[g].double().numpy() for g in ("router", "experts")])
    want = np.linalg.norm(pb - pa) / np.linalg.norm(pa - p0)
    assert m["param_drift"] == pytest.approx(want, rel=FP64_REL)


def test_identical_traces_give_zero_and_reordered_topk_is_not_a_flip():
    a = _trace(0)
    same = BackendTrace(
        "b", {"dtype": "fp64"}, a.params0, [replace(a.steps[0], topk=[t.flip(-1) for t in a.steps[0].topk])]
    )
    m = metrics.step_metrics(a.steps[0], same.steps[0], a.params0)
    assert m["logp_abs_diff_max"] == 0 and m["kl_k3_mean"] == 0 and m["router_flip_rate"] == 0
    assert m["param_drift"] == 0 and m["grad_cosine_min"] == pytest.approx(1.0, rel=FP64_REL)


def test_first_exceeded_respects_direction_nan_and_unmeasured():
    curves = [
        {"logp_abs_diff_mean": 1e-6, "grad_cosine_min": 0.99999, "router_flip_rate": None},
        {"logp_abs_diff_mean": 1e-6, "grad_cosine_min": 0.9, "router_flip_rate": None},
        {"logp_abs_diff_mean": float("nan"), "grad_cosine_min": 0.9, "router_flip_rate": None},
    ]
    tol = {"logp_abs_diff_mean": 1e-5, "grad_cosine_min": 0.999, "router_flip_rate": 0.0}
    assert metrics.first_exceeded(curves, tol) == {
        "logp_abs_diff_mean": 2,
        "grad_cosine_min": 1,
        "router_flip_rate": None,
    }


def test_probe_takes_the_same_coordinates_everywhere_and_groups_by_name():
    names = {
        "model.embed_tokens.weight": (50, 8),
        "model.layers.0.linear_attn.in_proj_qkv.weight": (24, 8),
        "model.layers.1.self_attn.q_proj.weight": (16, 8),
        "model.layers.0.mlp.gate.weight": (4, 8),
        "model.layers.0.mlp.experts.gate_up_proj": (4, 6, 8),
        "model.layers.0.mlp.shared_expert_gate.weight": (1, 8),
        "model.norm.weight": (8,),
        "lm_head.weight": (50, 8),
    }
    groups = {n: param_group(n) for n in names}
    assert groups["model.layers.0.mlp.gate.weight"] == "router"
    assert groups["model.layers.0.mlp.shared_expert_gate.weight"] == "experts"
    assert groups["model.layers.0.linear_attn.in_proj_qkv.weight"] == "gdn"
    assert groups["model.layers.1.self_attn.q_proj.weight"] == "attention"
    assert groups["lm_head.weight"] == groups["model.embed_tokens.weight"] == "embeddings"
    assert groups["model.norm.weight"] == "other"
    tensors = {n: torch.randn(s, dtype=torch.float64) for n, s in names.items()}
    numels = {n: t.numel() for n, t in tensors.items()}
    full = Probe(numels).take(tensors)
    assert sum(v.numel() for v in full.values()) == sum(numels.values())
    small = Probe(numels, budget=100)
    assert small.stride > 1
    one, two = small.take(tensors), small.take({n: t.clone() for n, t in reversed(tensors.items())})
    assert all(torch.equal(one[g], two[g]) for g in one)
    assert sum(v.numel() for v in one.values()) <= 100 + len(names)


def test_backend_names_parse_and_router_ablation_expands():
    spec = parse_backend("fsdp2:dtype=bf16:router=fp32:world=2:cfg.a.b=0.5")
    assert (spec.name, spec.dtype, spec.router, spec.world, spec.overrides) == (
        "fsdp2",
        "bf16",
        "fp32",
        2,
        (("a.b", "0.5"),),
    )
    assert parse_backend(spec.label) == spec
    for bad in ("nope", "reference:dtype=fp8", "reference:world=0", "reference:color=red", "reference:cfg.x=not-json"):
        with pytest.raises(ValueError):
            parse_backend(bad)
    cfg = align.AlignConfig(backends=("reference", "fsdp2"), router_ablation=True)
    assert [s.label for s in align.expand_backends(cfg)] == [
        "reference",
        "fsdp2:router=bf16",
        "fsdp2:router=fp32",
        "fsdp2:router=fp64",
    ]
    with pytest.raises(ValueError, match="tolerance metric"):
        align.AlignConfig(tolerances=(("logp_mean", 1.0),))
    with pytest.raises(ValueError, match="jobs"):
        align.AlignConfig(jobs=0)


@pytest.mark.usefixtures("needs_verl")
def test_stream_is_deterministic_and_verl_shaped():
    spec = data.get_preset("tiny-qwen3.5-moe").stream
    one, two = data.make_stream(spec, 512, 2, seed=7), data.make_stream(spec, 512, 2, seed=7)
    for b1, b2 in zip(one, two):
        assert all(torch.equal(b1[k], b2[k]) for k in data.BATCH_KEYS)
    b = one[0]
    g = spec.group_size
    assert torch.equal(b["prompts"][0], b["prompts"][g - 1])  # one prompt per group
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], 1))
    adv = b["advantages"].sum(-1) / b["response_mask"].sum(-1)  # GRPO: zero mean per group
    assert adv.view(-1, g).sum(-1).abs().max() < 1e-5


# ---- end to end ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def e2e(tmp_path_factory, needs_verl):
    """The README's main job, shortened: the tiny preset through reference, fsdp2 and veomni with
    the experts split over its 2 gloo ranks."""
    out = tmp_path_factory.mktemp("align")
    cfg = align.AlignConfig(backends=("reference", "fsdp2", "veomni:ep=2"), steps=2, out=str(out), progress=False)
    return cfg, align.run(cfg)


@pytest.mark.dist
@pytest.mark.parametrize("engine", ["fsdp2", "veomni:ep=2"])
def test_engines_match_reference_within_fp32_tolerances(e2e, engine):
    _, report = e2e
    by_label = {b["label"]: b for b in report["backends"]}
    assert by_label[engine]["status"] == "ok", by_label[engine]["reason"]
    assert by_label[engine]["world_size"] == 2
    (pair,) = [p for p in report["pairs"] if p["b"] == engine]
    assert pair["a"] == "reference" and pair["precision"] == "fp32"
    assert pair["tolerances"] == align.DEFAULT_TOLERANCES["fp32"]
    assert pair["ok"], pair["first_exceeded"]
    assert pair["one_step"]["logp_abs_diff_max"] > 0  # fp32 vs fp64: measured, not identical
    assert report["ok"] is True and report["exit_code"] == 0


def test_report_validates_and_schema_rejects_a_broken_report(e2e):
    jsonschema = pytest.importorskip("jsonschema", reason="the report schema check needs jsonschema (comes with Ray)")
    cfg, report = e2e
    on_disk = json.loads((Path(cfg.out) / "report.json").read_text())
    align.validate_report(on_disk)
    assert on_disk["schema"] == align.SCHEMA_VERSION and on_disk["git_sha"] == report["git_sha"]
    assert len(on_disk["pairs"][0]["curves"]) == cfg.steps
    broken = json.loads(json.dumps(on_disk))
    broken["pairs"][0]["one_step"]["logp_abs_diff_mean"] = "small"
    with pytest.raises(jsonschema.ValidationError):
        align.validate_report(broken)
    del broken["backends"]
    with pytest.raises(jsonschema.ValidationError):
        align.validate_report(broken)


def test_plots_are_written(e2e):
    _, report = e2e
    assert set(report["plots"]) == {"curves", "logp_hist"}
    for path in report["plots"].values():
        data = Path(path).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_reference_loss_is_the_grpo_objective(e2e):
    """The reference's loss equals GRPO's token-mean clipped objective recomputed here from its
    own log-probs and the stream (old log-probs, advantages): verl's loss is called as intended."""
    cfg, report = e2e
    stream = torch.load(Path(cfg.out) / "stream.pt", weights_only=False)
    trace = torch.load(Path(cfg.out) / "traces" / "reference.pt", weights_only=False)
    for batch, step in zip(stream, trace.steps):
        mask = batch["response_mask"].bool()
        old, adv = batch["old_log_probs"][mask].double(), batch["advantages"][mask].double()
        ratio = torch.exp(step.log_probs - old)
        per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * 3.0), per_token)
        assert step.loss == pytest.approx(per_token.mean().item(), rel=1e-9, abs=1e-12)


@pytest.mark.usefixtures("needs_verl")
def test_perturbed_backend_and_command_line_tolerance_give_nonzero_exit(tmp_path):
    """Through the CLI: a wrong rotary dim is flagged on every metric family at step 0; an fp32
    backend that is fine by default fails exactly the one tolerance tightened with --tol."""
    from typer.testing import CliRunner
    from verl_moe.tools.cli import app

    backends = f"reference,{PERTURBED},reference:dtype=fp32"
    args = ["align", "--backends", backends, "--steps", "1", "--out", str(tmp_path)]
    result = CliRunner().invoke(app, [*args, "--tol", "logp_abs_diff_mean=1e-12"])
    assert result.exit_code == 1, result.output
    assert "EXCEEDED" in result.output and "NOT ALIGNED" in result.output
    report = json.loads((tmp_path / "report.json").read_text())
    align.validate_report(report)
    pairs = {p["b"]: p for p in report["pairs"]}
    perturbed = pairs[PERTURBED]
    assert not perturbed["ok"] and perturbed["first_divergence_step"] == 0
    assert {"logp_abs_diff_mean", "kl_k3_mean", "loss_abs_diff", "grad_cosine_min"} <= set(
        perturbed["exceeded_at_step0"]
    )
    fp32 = pairs["reference:dtype=fp32"]
    assert fp32["tolerances"]["logp_abs_diff_mean"] == 1e-12
    assert fp32["exceeded_at_step0"] == ["logp_abs_diff_mean"]


@pytest.mark.usefixtures("needs_verl")
def test_bf16_router_in_the_fp64_reference_is_flagged(tmp_path):
    cfg = align.AlignConfig(backends=("reference", "reference:router=bf16"), steps=1, out=str(tmp_path), progress=False)
    report = align.run(cfg)
    (pair,) = report["pairs"]
    assert pair["precision"] == "fp64" and not pair["ok"] and report["exit_code"] == 1


@pytest.mark.dist
@pytest.mark.usefixtures("needs_verl")
def test_engines_align_on_the_tiny_qwen3_moe_preset(tmp_path, capsys):
    """The attention-only preset (no GatedDeltaNet) through both engines, experts split over 2 ranks;
    the two engine workers run at the same time (--jobs 2) and are also compared with each other."""
    cfg = align.AlignConfig(
        preset="tiny-qwen3-moe",
        backends=("reference", "fsdp2", "veomni:ep=2"),
        steps=2,
        out=str(tmp_path),
        progress=False,
        jobs=2,
        all_pairs=True,
    )
    report = align.run(cfg)
    align.validate_report(report)
    assert [b["status"] for b in report["backends"]] == ["ok", "ok", "ok"]
    pairs = [(p["a"], p["b"]) for p in report["pairs"]]
    assert pairs == [("reference", "fsdp2"), ("reference", "veomni:ep=2"), ("fsdp2", "veomni:ep=2")]
    for pair in report["pairs"]:
        assert pair["ok"], (pair["a"], pair["b"], pair["first_exceeded"])
        assert pair["precision"] == "fp32" and pair["one_step"]["router_flip_rate"] == 0.0
    assert report["exit_code"] == 0
    align.print_report(report)
    printed = capsys.readouterr().out
    assert "fsdp2 vs veomni:ep=2" in printed and "workers ran 2 at a time" in printed


def test_traces_load_with_weights_only_from_concurrent_threads(tmp_path):
    """--jobs loads the workers' traces from several threads at once; each must load with
    weights_only=True, also after a `safe_globals` context elsewhere exited (it removes its classes from
    the allowlist, whoever had added them)."""
    import threading

    from verl_moe.tools.align.trace import load_trace

    step = StepTrace(torch.zeros(3), torch.zeros(3), 0.5, 1.0, {}, {}, [torch.zeros(3, 2, dtype=torch.long)])
    path = tmp_path / "trace.pt"
    torch.save(BackendTrace("a", {"dtype": "fp64"}, steps=[step]), path)
    with torch.serialization.safe_globals([BackendTrace, StepTrace]):
        pass
    failures = []

    def load_many():
        for _ in range(40):
            try:
                assert load_trace(path).steps[0].loss == 0.5
            except Exception as e:  # noqa: BLE001 (collected, asserted below)
                failures.append(repr(e)[:120])

    threads = [threading.Thread(target=load_many) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[0]
