"""Checkpoints of MoeFsdp2Engine: bit-exact resume on 2 ranks, a save killed with SIGKILL,
loading on a different world size (model only), HF safetensors export, and the per-expert
vLLM names of the rollout weight sync (expected names built here from the fused tensors)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import verl_moe.models as vm
from dist import spawn
from engine_setup import build_engine, grpo_actor_config, make_batch, ppo_loss_fn, rank_slice, write_tiny_model
from verl.trainer.config import CheckpointConfig
from verl.utils import tensordict_utils as tu

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEDULE = dict(lr_warmup_steps=2, total_training_steps=10, lr_scheduler_type="cosine")


def _step_batch(step: int):
    """A fixed GRPO batch per step (old/ref log-probs near typical values; ratios partly clipped)."""
    data = make_batch(4, 5, 6, seed=100 + step)
    gen = torch.Generator().manual_seed(200 + step)
    shape = data["responses"].shape
    data["old_log_probs"] = -4.5 + 0.3 * torch.randn(shape, generator=gen)
    data["ref_log_prob"] = -4.5 + 0.3 * torch.randn(shape, generator=gen)
    return data


def _train(engine, steps, rank, world_size):
    loss_fn = ppo_loss_fn(grpo_actor_config())
    for step in steps:
        data = _step_batch(step)
        local = rank_slice(data, rank, world_size)
        tu.assign_non_tensor(local, global_batch_size=len(data), use_dynamic_bsz=False, micro_batch_size_per_gpu=1)
        with engine.train_mode():
            engine.train_batch(local, loss_fn)
        engine.lr_scheduler_step()


def _weights(engine) -> dict[str, torch.Tensor]:
    gen, _ = engine.get_per_tensor_param(layout="hf")
    return {name: t.clone() for name, t in gen}


def _engine(path, contents=("model", "optimizer", "extra")):
    config = CheckpointConfig(save_contents=list(contents), load_contents=list(contents))
    return build_engine(path, optimizer=SCHEDULE, checkpoint_config=config)


def _resume_bit_exact(rank: int, world_size: int, path: str, ckpt_root: str, killed_root: str) -> None:
    first = _engine(path, contents=("model", "optimizer", "extra", "hf_model"))
    _train(first, range(3), rank, world_size)
    first.save_checkpoint(os.path.join(ckpt_root, "step3"), global_step=3)
    torch.manual_seed(1234 + rank)  # RNG drift after the save must not leak into the resumed run
    _train(first, range(3, 5), rank, world_size)
    expected = _weights(first)
    lr_expected = first.lr_scheduler.get_last_lr()

    second = _engine(path)
    second.load_checkpoint(os.path.join(ckpt_root, "step3"))
    _train(second, range(3, 5), rank, world_size)
    got = _weights(second)
    assert second.lr_scheduler.get_last_lr() == lr_expected
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name

    # the HF export of step 3 holds the weights step 3 saved
    exported = vm.from_pretrained(os.path.join(ckpt_root, "step3", "huggingface")).state_dict()
    third = _engine(path, contents=("model",))
    third.load_checkpoint(os.path.join(ckpt_root, "step3"))
    for name, tensor in _weights(third).items():
        assert torch.equal(tensor, exported[name]), name

    # rollout weight sync: vLLM names split fused experts per expert (gate / up rows of gate_up_proj)
    vllm = {name: t.clone() for name, t in third.get_per_tensor_param()[0]}
    expected_vllm = {}
    for name, tensor in _weights(third).items():
        if name.endswith("mlp.experts.gate_up_proj"):
            width = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                expected_vllm[f"{name[: -len('gate_up_proj')]}{e}.gate_proj.weight"] = tensor[e, :width]
                expected_vllm[f"{name[: -len('gate_up_proj')]}{e}.up_proj.weight"] = tensor[e, width:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(tensor.shape[0]):
                expected_vllm[f"{name[: -len('down_proj')]}{e}.down_proj.weight"] = tensor[e]
        else:
            expected_vllm[name] = tensor
    assert sorted(vllm) == sorted(expected_vllm)
    for name, tensor in expected_vllm.items():
        assert torch.equal(vllm[name], tensor), name

    # a 1-rank checkpoint whose next save was SIGKILLed: the previous one loads on 2 ranks (model only)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        third.load_checkpoint(os.path.join(killed_root, "step2"))
    third.load_checkpoint(os.path.join(killed_root, "step1"))
    saved = torch.load(os.path.join(killed_root, "step1_weights.pt"))
    for name, tensor in _weights(third).items():
        assert torch.equal(tensor, saved[name]), name


def kill_during_save_child(path: str, root: str, port: int) -> None:
    """World-1 run: save step1 (complete), then hang inside the step2 save until killed."""
    import torch.distributed as dist
    from verl_moe.engines import checkpoint as ckpt

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    engine = _engine(path)
    _train(engine, range(1), 0, 1)
    engine.save_checkpoint(os.path.join(root, "step1"), global_step=1)
    torch.save(_weights(engine), os.path.join(root, "step1_weights.pt"))
    _train(engine, range(1, 2), 0, 1)
    real_rng_state = ckpt._rng_state

    def hang_after_sharded_write():
        print("MIDWAY", flush=True)  # dcp shards of step2 are on disk, nothing renamed yet
        time.sleep(600)
        return real_rng_state()

    ckpt._rng_state = hang_after_sharded_write
    engine.save_checkpoint(os.path.join(root, "step2"), global_step=2)


def _run_killed_save(path: str, root: str) -> None:
    from dist import free_port

    code = (
        f"import sys; sys.path[:0] = [{HERE!r}, {os.path.dirname(HERE)!r}]; "
        f"import test_checkpoint as t; t.kill_during_save_child({path!r}, {root!r}, {free_port()})"
    )
    env = dict(os.environ, VERL_PLATFORM="cpu", OMP_NUM_THREADS="1")
    child = subprocess.Popen([sys.executable, "-W", "ignore", "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        for line in child.stdout:
            if line.strip() == "MIDWAY":
                break
        assert os.path.isdir(os.path.join(root, "step2.tmp", "dcp")), "the step2 save never started"
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert not os.path.exists(os.path.join(root, "step2"))


@pytest.mark.dist
@pytest.mark.slow
def test_resume_kill_and_export(tmp_path):
    path = write_tiny_model(str(tmp_path / "model"))
    killed_root = str(tmp_path / "killed")
    _run_killed_save(path, killed_root)
    spawn(_resume_bit_exact, 2, path, str(tmp_path / "ckpt"), killed_root)


# ---- fresh process groups from the fork server (tests/engines/forked.py): a few seconds each ----


def _perturbed(engine, amount: float) -> dict[str, torch.Tensor]:
    """Shift every parameter by `amount` (a state a load must overwrite); returns the new weights."""
    with torch.no_grad():
        for p in engine.module.parameters():
            p.add_(amount)
    return _weights(engine)


def _assert_weights(engine, expected: dict[str, torch.Tensor]) -> None:
    for name, tensor in _weights(engine).items():
        assert torch.equal(tensor, expected[name]), name


def save_one_path_twice(rank: int, world_size: int, path: str, root: str) -> None:
    engine = _engine(path)
    first, second = os.path.join(root, "first"), os.path.join(root, "second")
    engine.save_checkpoint(first, global_step=1, max_ckpt_to_keep=1)
    saved = _perturbed(engine, 0.5)
    engine.save_checkpoint(first, global_step=2, max_ckpt_to_keep=1)
    assert engine._saved_checkpoints == [first]
    _perturbed(engine, 0.25)
    engine.load_checkpoint(first)
    _assert_weights(engine, saved)
    engine.save_checkpoint(second, global_step=3, max_ckpt_to_keep=1)  # prunes the other path only
    assert engine._saved_checkpoints == [second] and not os.path.exists(first)
    assert sorted(os.listdir(root)) == ["second"]


@pytest.mark.dist
def test_saving_one_path_twice_keeps_it(tmp_path):
    """max_ckpt_to_keep counts distinct paths: a re-save to the same path neither duplicates the
    entry nor prunes the folder it just wrote."""
    from forked import shared_server

    path = write_tiny_model(str(tmp_path / "model"))
    shared_server().run(__name__, "save_one_path_twice", 1, path, str(tmp_path / "ckpt")).check()


def _damage(rank: int, good: str, root: str) -> dict[str, str]:
    """Copies of `good`, each with one defect (rank 0 writes them); returns {defect: folder}."""
    import torch.distributed as dist

    shard = sorted(f for f in os.listdir(os.path.join(good, "dcp")) if f.endswith(".distcp"))[-1]
    cases = {
        "missing extra_rank1.pt": ("extra_rank1.pt", "remove"),
        f"missing {shard}": (f"dcp/{shard}", "remove"),
        f"truncated {shard}": (f"dcp/{shard}", "truncate"),
        "damaged dcp/.metadata": ("dcp/.metadata", "garble"),
        f"unreadable {shard}": (f"dcp/{shard}", "zero"),  # the right size: only reading finds it
    }
    folders = {}
    for i, (defect, (name, how)) in enumerate(cases.items()):
        folder = os.path.join(root, f"case{i}")
        folders[defect] = folder
        if rank != 0:
            continue
        shutil.copytree(good, folder)
        file = os.path.join(folder, name)
        if how == "remove":
            os.remove(file)
        elif how == "truncate":
            os.truncate(file, os.path.getsize(file) // 2)
        elif how == "zero":
            with open(file, "r+b") as f:
                f.write(bytes(os.path.getsize(file)))
        else:
            with open(file, "wb") as f:
                f.write(b"not a pickle")
    dist.barrier()
    return folders


def failing_loads(rank: int, world_size: int, path: str, root: str) -> None:
    engine = _engine(path)
    _train(engine, range(1), rank, world_size)
    good = os.path.join(root, "good")
    engine.save_checkpoint(good, global_step=1)
    saved = _weights(engine)
    current = _perturbed(engine, 0.5)
    lr = engine.lr_scheduler.get_last_lr()
    for defect, folder in _damage(rank, good, root).items():
        expected_type = FileNotFoundError if defect.startswith("missing") else ValueError  # CheckpointError's bases
        with pytest.raises(expected_type) as raised:
            engine.load_checkpoint(folder)
        message = str(raised.value)
        assert folder in message and "\n" not in message, message
        if defect.startswith("unreadable"):  # torch DCP's CheckpointException, wrapped
            assert "torch.distributed.checkpoint failed" in message, message
            continue
        assert defect.split()[-1] in message, message
        _assert_weights(engine, current)  # nothing was restored before the check failed
        assert engine.lr_scheduler.get_last_lr() == lr
    engine.load_checkpoint(good)
    _assert_weights(engine, saved)


def world_size_change(rank: int, world_size: int, path: str, folder: str, saved_file: str) -> None:
    """A 2-rank checkpoint on 1 rank: per-rank state refused, model and optimizer load."""
    engine = _engine(path)
    current = _perturbed(engine, 0.5)
    with pytest.raises(ValueError, match="saved by 2 ranks, this job has 1"):
        engine.load_checkpoint(folder)
    _assert_weights(engine, current)
    model_and_optimizer = _engine(path, contents=("model", "optimizer"))
    model_and_optimizer.load_checkpoint(folder)
    _assert_weights(model_and_optimizer, torch.load(saved_file))


def _save_weights(rank: int, world_size: int, path: str, folder: str, saved_file: str) -> None:
    engine = _engine(path)
    _train(engine, range(1), rank, world_size)
    engine.save_checkpoint(folder, global_step=1)
    weights = _weights(engine)
    if rank == 0:
        torch.save(weights, saved_file)


@pytest.mark.dist
def test_failing_load_fails_on_every_rank_before_restoring(tmp_path):
    """A missing or damaged file on any rank: every rank raises one clear error naming it, with the
    engine untouched; a 2-rank checkpoint with per-rank state is refused on 1 rank."""
    from forked import shared_server

    server = shared_server()
    path = write_tiny_model(str(tmp_path / "model"))
    server.run(__name__, "failing_loads", 2, path, str(tmp_path / "ckpt"), timeout=120).check()
    folder, saved_file = str(tmp_path / "two_ranks"), str(tmp_path / "two_ranks.pt")
    server.run(__name__, "_save_weights", 2, path, folder, saved_file).check()
    server.run(__name__, "world_size_change", 1, path, folder, saved_file).check()


class _Hostile:
    """Unpickling this runs code: it creates `marker`."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def hostile_extra_state(rank: int, world_size: int, path: str, root: str) -> None:
    import random

    import numpy as np

    engine = _engine(path)
    _train(engine, range(1), rank, world_size)
    folder = os.path.join(root, "ckpt")
    engine.save_checkpoint(folder, global_step=1)
    draws = (random.random(), np.random.rand(3).tolist(), torch.rand(3))
    # the RNG states come back through weights_only loading (python, numpy and torch alike)
    engine.load_checkpoint(folder)
    assert (random.random(), np.random.rand(3).tolist()) == draws[:2] and torch.equal(torch.rand(3), draws[2])
    torch.load(os.path.join(folder, "extra_rank0.pt"), weights_only=True)  # plain data only
    marker = os.path.join(root, "code_ran")
    torch.save({"lr_scheduler": _Hostile(marker), "rng": {}}, os.path.join(folder, "extra_rank0.pt"))
    current = _perturbed(engine, 0.5)
    with pytest.raises(BaseException) as raised:
        engine.load_checkpoint(folder)
    assert not os.path.exists(marker), "loading extra_rank0.pt ran code"
    assert isinstance(raised.value, ValueError) and "extra_rank0.pt is damaged or not plain data" in str(raised.value)
    _assert_weights(engine, current)


@pytest.mark.dist
def test_extra_state_is_read_without_running_code(tmp_path):
    """A pickle that runs code, dropped in as extra_rank0.pt, is refused and runs nothing."""
    from forked import shared_server

    path = write_tiny_model(str(tmp_path / "model"))
    shared_server().run(__name__, "hostile_extra_state", 1, path, str(tmp_path)).check()
