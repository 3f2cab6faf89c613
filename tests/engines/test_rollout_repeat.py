"""Runs repeat: two runs of verl's `main_ppo` with `recipe/tiny_cpu` as written and the same seed log the
same metrics at every step, exactly (`two_runs_log_the_same_metrics`, run for tiny_cpu by test_main_ppo.py's
two-step test, whose run it is). The CPU recipes set the switches themselves (`configs/determinism/`,
docs/reproducibility.md): the content-ordered replay buffer (verl's v1 trainer otherwise takes a batch in
the order its trajectories finished) and, but in exact mode, verl's `full_determinism` on our rollout
(sampling streams keyed by verl's stable request ids, one request decoding at a time). The other CPU
recipes (veomni, PPO, exact) repeat the same check in the slow suite.

The two runs go concurrently (two Ray clusters) to halve the wall time, most of it process start-up.
Only wall-clock and memory readings may differ.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import random
import signal
import subprocess
import uuid

import pytest
from verl_moe.engines.rollout.content_order import content_order

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 2
RUN_TIMEOUT_S = 900
# recipe -> extra environment of its runs (exact mode on CPU needs torch's scalar kernels)
SLOW_RECIPES = {"tiny_cpu_veomni": {}, "tiny_cpu_ppo": {}, "tiny_cpu_exact": {"ATEN_CPU_CAPABILITY": "default"}}
# seconds and bytes, not results
WALL_CLOCK = ("timing_s/", "timing_per_token_ms/", "perf/", "actor/perf/", "critic/perf/")


def test_content_order_ignores_arrival_order_and_uids():
    """The same trajectories listed in any order under fresh uids come out in one order of content;
    prompt groups stay whole (GRPO's n copies of 3 prompts, two of them the same text)."""
    rng = random.Random(0)
    prompts = [b"p0", b"p1", b"p0"]
    groups = [[prompt + bytes([rng.randrange(3)]) for _ in range(4)] for prompt in prompts]

    def listing(seed):
        uids = [str(uuid.UUID(int=random.Random(seed).getrandbits(128) + g)) for g in range(len(groups))]
        items = [(f"{uids[g]}_{s}_0", seq, g) for g, group in enumerate(groups) for s, seq in enumerate(group)]
        random.Random(seed).shuffle(items)
        order = content_order([k for k, _, _ in items], [seq for _, seq, _ in items])
        # what the trainer sees: sequences in order, and which positions share a group
        seen = [items[i] for i in order]
        first = {}
        return [seq for _, seq, _ in seen], [first.setdefault(k.split("_")[0], p) for p, (k, _, _) in enumerate(seen)]

    reference = listing(0)
    assert all(listing(seed) == reference for seed in range(1, 20))
    sequences, group_of = reference
    for p in range(len(sequences)):  # groups contiguous
        assert group_of[p] in (p, group_of[p - 1])


def test_poll_interval_reaches_verls_poll_and_must_be_positive():
    """`sampler_kwargs.poll_interval` is the interval verl's sync buffer sleeps between looks for a
    full batch (its `_wait_for_next_poll` reads `poll_interval`); verl's own default otherwise."""
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
    from verl_moe.engines.rollout.content_order import ContentOrderedReplayBuffer

    def build(**sampler_kwargs):
        return ContentOrderedReplayBuffer(
            trainer_mode="sync", trainer_config={}, max_off_policy_threshold=None,
            max_off_policy_strategy="drop", sampler_kwargs=sampler_kwargs,
        )  # fmt: skip

    default = inspect.signature(ReplayBuffer.__init__).parameters["poll_interval"].default
    assert build(poll_interval=0.05).poll_interval == 0.05 != default
    assert build().poll_interval == default
    with pytest.raises(ValueError, match="poll_interval must be > 0"):
        build(poll_interval=0)


def _toy_rl():
    spec = importlib.util.spec_from_file_location("toy_rl", os.path.join(ROOT, "scripts", "toy_rl.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _start(toy_rl, paths, workdir, recipe, env):
    command = toy_rl.main_ppo_command(recipe, paths, STEPS, ["trainer.val_before_train=false"])
    workdir.mkdir()
    with open(workdir / "main_ppo.log", "w") as out:
        return subprocess.Popen(
            command, env={**toy_rl.main_ppo_env(str(workdir / "metrics.jsonl")), **env}, cwd=workdir, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def _metrics(workdir) -> dict[int, dict]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["data"] for r in rows}


def _results(metrics: dict[int, dict]) -> dict[int, dict]:
    return {step: {k: v for k, v in data.items() if not k.startswith(WALL_CLOCK)} for step, data in metrics.items()}


def two_runs_log_the_same_metrics(tmp_path, recipe: str, env: dict[str, str]) -> dict[int, dict]:
    """Run the recipe twice at once and assert their metrics equal but wall-clock readings; the first run's
    {step: metrics}."""
    toy_rl = _toy_rl()
    paths = toy_rl.make(str(tmp_path / "toy"), task="arith")
    workdirs = [tmp_path / "run0", tmp_path / "run1"]
    procs = [_start(toy_rl, paths, w, recipe, env) for w in workdirs]
    try:
        codes = [p.wait(timeout=RUN_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for code, w in zip(codes, workdirs):
        assert code == 0, f"main_ppo exit {code}:\n{(w / 'main_ppo.log').read_text()[-6000:]}"
    logged = _metrics(workdirs[0])
    first, second = _results(logged), _results(_metrics(workdirs[1]))
    assert sorted(first) == sorted(second) == list(range(1, STEPS + 1))
    for step in first:
        assert first[step].keys() == second[step].keys()
        differ = {k: (v, second[step][k]) for k, v in first[step].items() if v != second[step][k]}
        assert not differ, (step, differ)
    if "actor/kl_loss" in first[2]:  # the KL to the reference (not in PPO): step 2 sampled from updated weights
        assert first[2]["actor/kl_loss"] > 0
    return logged


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("recipe", sorted(SLOW_RECIPES))
def test_two_runs_of_every_cpu_recipe_log_the_same_metrics(tmp_path, recipe):
    two_runs_log_the_same_metrics(tmp_path, recipe, SLOW_RECIPES[recipe])
