"""Exact mode through verl's own trainer: `python -m verl.trainer.main_ppo` with `recipe/tiny_cpu_exact` (exact
mode for the actor, the reference model and our rollout; verl's rollout correction in bypass mode) on the toy
model and data of `test_main_ppo.py`, 2 steps, checked from verl's JSONL file logger. The process runs torch's
scalar cpu kernels (`ATEN_CPU_CAPABILITY=default`, which exact mode on cpu needs; Ray's workers inherit it).

- With `bypass_mode=false` verl's trainer recomputes the old log-probs and compares them with the rollout's:
  verl's `training/rollout_probs_diff_max` and our `rollout/logprob_abs_diff_mean` / `_max` (`engines/rollout/
  logprob_diff.py`) are exactly 0 at both steps, in bf16 (the default suite) and in fp32 (slow). In fast mode
  the same metric is above 0 (`test_main_ppo.py`'s tiny_cpu run asserts it), so the check can fail; the bf16
  run needs the rollout to hold the MoE routers in fp32 as the trainer does (it measured up to 0.019 without).
- With the recipe as written (bypass on), the run exits 0 with finite losses and the old-log-prob pass is
  absent: verl logs neither the entropy that pass computes (`actor/entropy`) nor its comparison metrics (slow,
  bf16 and fp32; verl's `timing_s/old_log_prob` remains, timing the copy of the rollout's log-probs). The old
  log-probs are then the rollout's, and the update's first forward (at the weights the rollout sampled with)
  gives each token the same log-prob: verl's `actor/ppo_kl` (the mean of their differences) is exactly 0.

Default suite: one run (bf16, bypass off), 1.5-4 min on 2 cores; the other three are marked slow.
"""

from __future__ import annotations

import math

import pytest
from test_main_ppo import RUN_TIMEOUT_S, SHORT_STEPS, _check_run, _compose, _run_main_ppo, _toy_rl

RECIPE = "tiny_cpu_exact"
BF16 = (
    "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
    "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=bf16",
    "actor_rollout_ref.rollout.dtype=bfloat16",
)
DTYPES = {"bf16": BF16, "fp32": ()}
NO_BYPASS = ("algorithm.rollout_correction.bypass_mode=false",)
# rollout vs trainer log-probs over the response tokens: verl's (in probability space) and ours
DIFFS = ("training/rollout_probs_diff_max", "rollout/logprob_abs_diff_mean", "rollout/logprob_abs_diff_max")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    toy_rl = _toy_rl()
    return toy_rl, toy_rl.make(str(tmp_path_factory.mktemp("toy_exact")), task="arith")


def _run(toy, tmp_path, monkeypatch, overrides) -> dict[int, dict]:
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")  # main_ppo's environment is a copy of this one
    toy_rl, paths = toy
    return _run_main_ppo(toy_rl, paths, RECIPE, tmp_path, SHORT_STEPS, list(overrides))


def test_exact_recipe_is_tiny_cpu_in_exact_mode_with_bypass():
    """Everything but the three exact switches, bypass mode and the experiment name stays recipe/tiny_cpu's
    with `determinism=ordered` (exact ops make the rollout's log-probs batch-invariant without decoding one
    request at a time)."""
    from omegaconf import OmegaConf

    exact = OmegaConf.to_container(_compose(RECIPE))
    tiny = OmegaConf.to_container(_compose("tiny_cpu", ["determinism=ordered"]))
    for cfg in (exact, tiny):
        cfg["trainer"].pop("experiment_name")
        cfg["algorithm"]["rollout_correction"].pop("bypass_mode")
    rollout_ops = exact["actor_rollout_ref"]["rollout"]["engine_kwargs"].pop("verl_moe")["ops"]
    switches = [exact["actor_rollout_ref"][role]["fsdp_config"]["ops"].pop("exact") for role in ("actor", "ref")]
    for role in ("actor", "ref"):
        tiny["actor_rollout_ref"][role]["fsdp_config"]["ops"].pop("exact")
    assert exact == tiny
    assert switches == [True, True] and rollout_ops == {"exact": True}
    assert _compose(RECIPE).algorithm.rollout_correction.bypass_mode


def _assert_exact(steps: dict) -> None:
    _check_run(steps, SHORT_STEPS)
    for step in range(1, SHORT_STEPS + 1):
        assert [steps[step][key] for key in DIFFS] == [0.0] * len(DIFFS), (step, steps[step])


@pytest.mark.dist
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("dtype", ["bf16", pytest.param("fp32", marks=pytest.mark.slow)])
def test_exact_rollout_log_probs_equal_the_trainers(toy, tmp_path, monkeypatch, dtype):
    _assert_exact(_run(toy, tmp_path, monkeypatch, [*DTYPES[dtype], *NO_BYPASS]))


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_exact_recipe_with_bypass_trains_without_the_old_log_prob_pass(toy, tmp_path, monkeypatch, dtype):
    steps = _run(toy, tmp_path, monkeypatch, DTYPES[dtype])
    assert sorted(steps) == list(range(1, SHORT_STEPS + 1))
    for step, metrics in steps.items():
        for key in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/score/mean"):
            assert math.isfinite(metrics[key]), (step, key, metrics.get(key))
        skipped = [key for key in ("actor/entropy", *DIFFS) if key in metrics]
        assert not skipped, (step, skipped)
        assert metrics["actor/ppo_kl"] == 0.0, (step, metrics["actor/ppo_kl"])
    assert steps[2]["actor/kl_loss"] > 1e-5, "the first update did not move the policy"
