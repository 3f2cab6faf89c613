"""verl's SPMD SFT trainer on our engines, on CPU: `torchrun -m verl.trainer.sft_trainer` (as verl's own
`run_sft_engine.sh` starts it) with `VERL_PLATFORM=cpu` and `trainer.device=cpu`, 2 gloo ranks, the tiny
Qwen3.5-MoE and the SFT parquet of `scripts/toy_rl.py`, once per engine (`fsdp2`; `veomni` with the routed
experts split over both ranks).

The reference is verl's trainer itself: run A trains 4 steps with validation after each and checkpoints at
steps 2 and 4; run B starts from A's step-2 checkpoint (`trainer.resume_mode=resume_path`). B must log steps
3 and 4 only, with A's train loss, grad norm, learning rate and validation loss at both: the step-3 loss needs
the weights and the data loader's position back, the validation loss after step 3 the optimizer state too.
Each run takes about 15 s on 2 cores, most of it process start-up.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shlex
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from dist import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_TIMEOUT_S = 300
STEPS = 4
RESUME_FROM = 2
COMPARED = ("train/loss", "train/grad_norm", "train/lr", "val/loss")
# engine -> (Hydra overrides selecting verl's engine and optimizer config, the class our selector builds)
ENGINES = {
    "fsdp2": (["engine=fsdp", "optim=fsdp", "engine.strategy=fsdp2"], "MoeFsdp2Engine"),
    "veomni": (["engine=veomni", "optim=veomni", "engine.expert_parallel_size=2"], "MoeVeOmniEngine"),
}
# the README's command, less its paths and engine choice
README_OVERRIDES = [
    "data.train_batch_size=8",
    "data.micro_batch_size_per_gpu=2",
    "data.max_length=64",
    "data.num_workers=0",
    "trainer.device=cpu",
]


def _toy_rl():
    spec = importlib.util.spec_from_file_location("toy_rl", os.path.join(ROOT, "scripts", "toy_rl.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return _toy_rl().make(str(tmp_path_factory.mktemp("toy_sft")), train=32, val=8)


def _sft_command(paths: dict[str, str], ckpt, engine_overrides: list[str], extra=()) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "verl.trainer.sft_trainer",
        f"model.path={paths['model']}",
        f"data.train_files={paths['sft_train']}",
        f"data.val_files={paths['sft_val']}",
        *README_OVERRIDES,
        *engine_overrides,
        "trainer.logger=[console,file]",
        f"trainer.total_training_steps={STEPS}",
        "trainer.test_freq=1",
        f"trainer.save_freq={RESUME_FROM}",
        f"trainer.default_local_dir={ckpt}",
        *extra,
    ]  # fmt: skip


def _run(command: list[str], workdir) -> tuple[dict[int, dict], str]:
    """Run in `workdir` in its own process group (killed whole on timeout); ({step: metrics}, log)."""
    workdir.mkdir()
    metrics, log = workdir / "metrics.jsonl", workdir / "sft.log"
    env = dict(os.environ, VERL_PLATFORM="cpu", VERL_FILE_LOGGER_PATH=str(metrics))
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command, env=env, cwd=workdir, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    text = log.read_text()
    assert code == 0, f"sft_trainer exit {code}:\n{text[-6000:]}"
    steps: dict[int, dict] = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        steps.setdefault(row["step"], {}).update(row["data"])
    return steps, text


@pytest.mark.dist
@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_sft_trainer_resumes_where_it_saved(toy, tmp_path, engine):
    overrides, engine_cls = ENGINES[engine]
    first, log = _run(_sft_command(toy, tmp_path / "ckpt_a", overrides), tmp_path / "a")
    assert f"{engine_cls}'>" in log, "our selector did not build our engine"
    assert sorted(first) == list(range(1, STEPS + 1))
    for step, metrics in first.items():
        for key in COMPARED:
            assert math.isfinite(metrics[key]), (step, key, metrics.get(key))
    # the comparison below can tell steps apart: training moves the validation loss
    assert first[STEPS]["val/loss"] < first[1]["val/loss"], [first[s]["val/loss"] for s in sorted(first)]
    saved = tmp_path / "ckpt_a" / f"global_step_{RESUME_FROM}"
    assert (saved / "COMPLETE").exists(), sorted(p.name for p in saved.parent.iterdir())

    resume = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={saved}"]
    resumed, _ = _run(_sft_command(toy, tmp_path / "ckpt_b", overrides, resume), tmp_path / "b")
    assert sorted(resumed) == list(range(RESUME_FROM + 1, STEPS + 1))
    for step in resumed:
        for key in COMPARED:
            assert resumed[step][key] == pytest.approx(first[step][key], rel=1e-6, abs=0), (step, key)


def test_readme_sft_command_is_the_tested_one():
    """The README's torchrun command carries the overrides this test runs (paths and engine aside)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read().replace("\\\n", " ")
    lines = [line for line in text.splitlines() if "-m verl.trainer.sft_trainer" in line]
    assert len(lines) == 1, lines
    words = shlex.split(lines[0])
    assert words[0] == "VERL_PLATFORM=cpu"
    assert {*README_OVERRIDES, *ENGINES["fsdp2"][0][:2]} <= set(words), words


def test_spmd_process_group_is_gloo_on_cpu(monkeypatch):
    """verl's `initialize_global_process_group` (what torchrun-started trainers call) gets plain gloo on
    the cpu platform; verl's own function builds the string torch rejects."""
    import verl.utils.distributed as verl_distributed

    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    fixed = verl_distributed.initialize_global_process_group
    with pytest.raises(ValueError, match="Duplicate device type cpu"):
        fixed.__wrapped__(timeout_second=60)
    assert fixed(timeout_second=60) == (0, 0, 1)
    try:
        assert dist.get_backend() == "gloo"
        value = torch.ones(2)
        dist.all_reduce(value)
        assert value.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()
