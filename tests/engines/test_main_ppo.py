"""verl's own trainer end to end on CPU: `python -m verl.trainer.main_ppo` with `recipe/tiny_cpu`
(our fsdp2 engine) and `recipe/tiny_cpu_veomni` (our veomni engine, experts split over the 2
ranks), both with our `verl_moe` rollout, on a tiny Qwen3.5-MoE, a byte-level tokenizer and
gsm8k-shaped parquet made here (`scripts/toy_rl.py`, arith task: "a+b=" prompts, a rule reward
with partial credit for digits). Per recipe, checked from verl's JSONL file logger: a SHORT_STEPS run
in the default suite (exit, metrics, fp32 reference, weights reaching the rollout) and a STEPS run,
marked slow, that also checks learning:

- the run exits 0 and every step logs finite loss, grad norm, reward, KL and rollout metrics;
- the reference model is fp32 like the actor: the KL loss of step 1 (one on-policy update per
  step, so measured before any update) is 0 (it was 1.2e-6 with verl's bf16 ref config);
- fast mode is not exact: the rollout's log-probs differ from the trainer's (`rollout/logprob_abs_diff_max`
  above 0; `test_main_ppo_exact.py` asserts it 0 in exact mode);
- weights reach the rollout: from step 2 on, the k3 KL between the rollout's log-probs and the
  trainer's (`rollout_corr/k3_kl`) stays under 1e-3 of the k3 KL between the trainer and the
  reference (`actor/kl_loss`, the same estimator on the same tokens). The reference holds the
  initial weights, so a rollout that kept them would score as much as the reference does;
- it learns: the mean reward of the last 3 steps exceeds the first 3 steps' by 0.2 and by 3x
  (measured over 4 runs: ~0.045 -> ~0.9); `verl-moe curves` plots the reward curve from the file.

`recipe/tiny_cpu_ppo` (PPO with GAE: our actor and our critic, the critic a value head on the same spec) runs
SHORT_STEPS in the default suite: finite actor and critic metrics, a critic that trains (vf_loss and values
change between steps), and the values the critic's update sees equal to those verl computed for GAE with the
same weights (value clipping at 1e-6 never acts). The critic's values and gradients against transformers'
value model of the same weights are checked in `test_critic_worker.py` (the rollout's batches are not known
to the test here).

Each run is a whole Ray cluster (trainer ranks, TransferQueue, agent loop, reward loop, rollout
server): 2-4 min on a 2-core machine, most of it process start-up.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess

import pytest
from test_rollout_repeat import two_runs_log_the_same_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 10
SHORT_STEPS = 2
RUN_TIMEOUT_S = 1200
PER_STEP = (
    "actor/loss",
    "actor/grad_norm",
    "actor/kl_loss",
    "critic/score/mean",
    "response_length/mean",
    "timing_s/gen",
    "training/rollout_probs_diff_max",
    "rollout_corr/k3_kl",
)
CRITIC_PER_STEP = (
    "actor/pg_loss",
    "actor/grad_norm",
    "critic/vf_loss",
    "critic/grad_norm",
    "critic/values/mean",
    "critic/values/max",
    "critic/values/min",
    "critic/advantages/mean",
    "critic/score/mean",
)


def _load(name: str, *path: str):
    """A module by file path (scripts/ is no package; tests/configs is not on this folder's path)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, *path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _toy_rl():
    return _load("toy_rl", "scripts", "toy_rl.py")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    toy_rl = _toy_rl()
    return toy_rl, toy_rl.make(str(tmp_path_factory.mktemp("toy_rl")), task="arith")


def _run_main_ppo(toy_rl, paths, recipe: str, workdir, steps: int, overrides=()) -> dict[int, dict]:
    """Run main_ppo in its own process group (killed whole on timeout); {step: metrics}."""
    metrics = workdir / "metrics.jsonl"
    command = toy_rl.main_ppo_command(recipe, paths, steps, ["trainer.val_before_train=false", *overrides])
    log = workdir / "main_ppo.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command, env=toy_rl.main_ppo_env(str(metrics)), cwd=workdir, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            code = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    tail = log.read_text()[-6000:]
    assert code == 0, f"main_ppo {recipe} exit {code}:\n{tail}"
    steps = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        steps[row["step"]] = row["data"]
    return steps


def _compose(recipe: str, overrides=()):
    import verl_moe.configs
    from hydra import compose, initialize_config_dir

    configs = os.path.dirname(os.path.abspath(verl_moe.configs.__file__))
    with initialize_config_dir(config_dir=configs, version_base=None):
        return compose(config_name=f"recipe/{recipe}", overrides=list(overrides))


@pytest.mark.parametrize("recipe", ["tiny_cpu", "tiny_cpu_veomni"])
def test_tiny_recipes_fit_a_small_cpu_machine(recipe):
    """What the runs below depend on, in seconds: our rollout in fp32, Ray and TransferQueue sized for
    2 cores (verl's 8 storage units of 1 CPU each never start there), few helper processes, the
    file logger, and actor and reference engines both computing in fp32 (a bf16 reference puts
    KL 1.2e-6 between identical weights)."""
    import torch
    from verl_moe.engines.config import precision_dtypes

    # the ActorConfig objects verl's worker builds for the actor and the reference model
    _actor_and_ref = _load("recipe_configs", "tests", "configs", "test_configs.py")._actor_and_ref

    cfg = _compose(recipe)
    rollout = cfg.actor_rollout_ref.rollout
    assert (rollout.name, rollout.dtype) == ("verl_moe", "float32")
    ranks = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    storage_units = cfg.transfer_queue.backend.SimpleStorage.num_data_storage_units
    # trainer ranks + TransferQueue's controller and storage units, each 1 CPU, + 1 free for scheduling
    assert cfg.ray_kwargs.ray_init.num_cpus >= ranks + 1 + storage_units + 1
    assert rollout.agent.num_workers == 1 and cfg.reward.num_workers == 1
    assert "file" in cfg.trainer.logger
    actor, ref = _actor_and_ref(cfg)
    assert not actor.engine.forward_only and ref.engine.forward_only
    for engine in (actor.engine, ref.engine):
        assert precision_dtypes(engine) == (torch.float32,) * 3, (recipe, engine)
    single_gpu = _compose(recipe, ["platform=gpu_single"])
    assert (single_gpu.trainer.device, single_gpu.trainer.n_gpus_per_node) == ("cuda", 1)
    assert single_gpu.actor_rollout_ref.rollout.name == "verl_moe"
    assert _compose(recipe, ["platform=gpu"]).actor_rollout_ref.rollout.name == "vllm"


def test_vllm_recipe_is_tiny_cpu_with_verls_vllm_rollout():
    """recipe/tiny_cpu_vllm repeats tiny_cpu's trainer side (Hydra lets only the primary config set the
    search path): everything but the rollout, the experiment name and the determinism switches (none of our
    rollout's for verl's) must stay equal; the rollout fits a CPU host (one replica per rank, no sleep mode, a
    small explicit KV cache per replica)."""
    from omegaconf import OmegaConf

    vllm = OmegaConf.to_container(_compose("tiny_cpu_vllm"))
    tiny = OmegaConf.to_container(_compose("tiny_cpu", ["determinism=none"]))
    rollout = vllm["actor_rollout_ref"].pop("rollout")
    tiny["actor_rollout_ref"].pop("rollout")
    vllm["trainer"].pop("experiment_name"), tiny["trainer"].pop("experiment_name")
    assert vllm == tiny
    assert (rollout["name"], rollout["tensor_model_parallel_size"]) == ("vllm", 1)
    assert not rollout["enable_sleep_mode"] and not rollout["free_cache_engine"] and rollout["calculate_log_probs"]
    kv_bytes = rollout["engine_kwargs"]["vllm"]["kv_cache_memory_bytes"]
    assert vllm["trainer"]["n_gpus_per_node"] * kv_bytes <= 2**30


def _check_run(steps: dict, n_steps: int) -> None:
    """Every step logged finite metrics; the reference equals the actor before the first update; from
    step 2 on the rollout's log-probs follow the trained policy, not the initial weights."""
    assert sorted(s for s in steps if "critic/score/mean" in steps[s]) == list(range(1, n_steps + 1))
    for step in range(1, n_steps + 1):
        for key in PER_STEP:
            assert math.isfinite(steps[step][key]), (step, key, steps[step].get(key))
    assert steps[1]["actor/kl_loss"] <= 1e-9, steps[1]["actor/kl_loss"]
    assert steps[2]["actor/kl_loss"] > 1e-5, "the first update did not move the policy"
    for step in range(2, n_steps + 1):
        rollout_kl, policy_kl = steps[step]["rollout_corr/k3_kl"], steps[step]["actor/kl_loss"]
        assert rollout_kl <= 1e-3 * policy_kl, (step, rollout_kl, policy_kl)


@pytest.mark.dist
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("recipe", ["tiny_cpu", "tiny_cpu_veomni"])
def test_main_ppo_runs_two_steps(toy, tmp_path, recipe):
    toy_rl, paths = toy
    if recipe == "tiny_cpu":  # the README's recipe runs twice at once: both runs must log the same metrics
        steps = two_runs_log_the_same_metrics(tmp_path, recipe, {})
    else:
        steps = _run_main_ppo(toy_rl, paths, recipe, tmp_path, SHORT_STEPS)
    _check_run(steps, SHORT_STEPS)
    # fast mode: the rollout's log-probs are not the trainer's bitwise (test_main_ppo_exact.py asserts 0 in exact mode)
    assert all(steps[s]["rollout/logprob_abs_diff_max"] > 0 for s in range(1, SHORT_STEPS + 1)), steps


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("recipe", ["tiny_cpu", "tiny_cpu_veomni"])
def test_main_ppo_trains_and_learns(toy, tmp_path, recipe):
    toy_rl, paths = toy
    steps = _run_main_ppo(toy_rl, paths, recipe, tmp_path, STEPS)
    _check_run(steps, STEPS)
    rewards = [steps[s]["critic/score/mean"] for s in range(1, STEPS + 1)]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last >= first + 0.2 and last >= 3 * first, rewards

    from verl_moe.tools.curves import CurvesConfig, run

    report = run(CurvesConfig(runs=(f"{recipe}={tmp_path / 'metrics.jsonl'}",), metrics=("reward",), out=str(tmp_path)))
    assert report["metrics"][0]["keys"][recipe] == "critic/score/mean"
    assert os.path.getsize(report["plot"]) > 0


def test_ppo_recipe_has_our_critic(toy):
    """recipe/tiny_cpu_ppo: GAE, a critic on our fsdp2 engine in fp32 that starts from the actor's checkpoint,
    no reference model (no KL term), sized like tiny_cpu."""
    import torch
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass
    from verl_moe.engines.config import MoeFsdp2EngineConfig, precision_dtypes

    model = toy[1]["model"]
    cfg = _compose("tiny_cpu_ppo", [f"actor_rollout_ref.model.path={model}"])
    assert cfg.algorithm.adv_estimator == "gae" and need_critic(cfg) and not need_reference_policy(cfg)
    critic = omega_conf_to_dataclass(cfg.critic)
    assert isinstance(critic.engine, MoeFsdp2EngineConfig) and critic.engine.strategy == "fsdp2"
    assert precision_dtypes(critic.engine) == (torch.float32,) * 3
    assert critic.model.path == model
    tiny = _compose("tiny_cpu", [f"actor_rollout_ref.model.path={model}"])
    for key in ("actor_rollout_ref.rollout", "data", "ray_kwargs", "transfer_queue"):  # tiny_cpu's scale and platform
        assert OmegaConf.to_container(OmegaConf.select(cfg, key)) == OmegaConf.to_container(OmegaConf.select(tiny, key))


@pytest.mark.dist
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_main_ppo_with_our_critic(toy, tmp_path):
    toy_rl, paths = toy
    steps = _run_main_ppo(toy_rl, paths, "tiny_cpu_ppo", tmp_path, SHORT_STEPS, ["critic.cliprange_value=1e-6"])
    assert sorted(s for s in steps if "critic/vf_loss" in steps[s]) == list(range(1, SHORT_STEPS + 1))
    for step in range(1, SHORT_STEPS + 1):
        for key in CRITIC_PER_STEP:
            assert math.isfinite(steps[step][key]), (step, key, steps[step].get(key))
        # the update's forward gives the values verl computed for GAE (same weights, one update per step)
        assert steps[step]["critic/vf_clipfrac"] == 0.0, steps[step]
    assert steps[1]["critic/grad_norm"] > 0
    for key in ("critic/vf_loss", "critic/values/mean"):
        assert steps[1][key] != steps[2][key], (key, steps[1][key], steps[2][key])


@pytest.mark.dist
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_main_ppo_with_verls_vllm_rollout(tmp_path_factory, tmp_path):
    """recipe/tiny_cpu_vllm: verl's own vLLM rollout (vLLM's CPU build) fed by our fsdp2 engine, on the tiny
    Qwen3-MoE that vLLM runs in fp32 like the trainer. Besides the checks above, in log-prob space: rollout
    and trainer agree to <= 1e-5 at every step (the weight sync of `test_vllm_cpu.py`, now through verl's
    trainer and replicas), so after the step-1 update vLLM serves the trained weights."""
    pytest.importorskip("vllm", reason="verl's vLLM rollout on CPU needs `make install-vllm`")
    toy_rl = _toy_rl()
    paths = toy_rl.make(str(tmp_path_factory.mktemp("toy_vllm")), task="arith", size="tiny-qwen3-moe")
    steps = _run_main_ppo(
        toy_rl, paths, "tiny_cpu_vllm", tmp_path, SHORT_STEPS, ["actor_rollout_ref.rollout.dtype=float32"]
    )
    _check_run(steps, SHORT_STEPS)
    for step in range(1, SHORT_STEPS + 1):
        assert steps[step]["rollout/logprob_abs_diff_max"] <= 1e-5, (step, steps[step])
