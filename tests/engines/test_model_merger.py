"""Our checkpoints and verl's model merger: `python -m verl.model_merger merge --backend fsdp` on one of
our folders stops with one line naming our export and command; that command writes an HF folder
that transformers loads with the weights the checkpoint saved (not those of the config folder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers
import verl_moe.models as vm
from dist import spawn
from engine_setup import tiny_config, tiny_model
from torch.distributed.device_mesh import init_device_mesh
from verl_moe.engines import checkpoint as ckpt
from verl_moe.engines import model_merger
from verl_moe.models.fsdp_plan import FsdpPlan, fully_shard_model

# checkpoint name -> (tied lm_head, HF export in the checkpoint)
SAVES = {"dcp_only": (False, False), "exported": (False, True), "tied": (True, False)}
TOKENIZER_FILE = "tokenizer_config.json"


def _save(rank: int, world_size: int, root: str) -> None:
    """Per case: the trained model's HF folder (config, a tokenizer file, the weights before training),
    then the weights moved (as training would) and saved sharded over the ranks."""
    for name, (tied, export) in SAVES.items():
        config = tiny_config()
        config.tie_word_embeddings = tied
        model = tiny_model(config)
        if rank == 0:
            vm.save_pretrained(model, os.path.join(root, name, "config"))
            with open(os.path.join(root, name, "config", TOKENIZER_FILE), "w") as f:
                json.dump({"model_max_length": 64}, f)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        if rank == 0:
            torch.save(model.state_dict(), os.path.join(root, name, "trained.pt"))
        fully_shard_model(model, model, FsdpPlan(mesh=init_device_mesh("cpu", (world_size,))))
        path = os.path.join(root, name, "global_step_1", "actor")
        ckpt.save(path, model=model, optimizer=None, lr_scheduler=None, global_step=1, hf_export=export)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("merger"))
    spawn(_save, 2, root)
    return root


def _actor(root: str, name: str) -> str:
    return os.path.join(root, name, "global_step_1", "actor")


@pytest.mark.dist
@pytest.mark.parametrize("name", ["dcp_only", "exported"])
def test_verl_merger_stops_with_one_line(saved, tmp_path, name):
    actor, target = _actor(saved, name), str(tmp_path / "hf")
    argv = ["-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir", actor, "--target_dir", target]
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True)
    assert out.returncode == 1, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr[-3000:]
    line = lines[0]
    assert line.startswith(f"verl_moe: {actor} is a verl_moe checkpoint")
    assert f"{model_merger.COMMAND} --local_dir {actor} --target_dir {target}" in line
    if name == "exported":
        assert f"its merged HF model is {os.path.join(actor, 'huggingface')}" in line
    else:
        assert "holds no HF export" in line and line.endswith("--config_dir <the trained model's HF folder>")


@pytest.mark.dist
@pytest.mark.parametrize("name", list(SAVES))
def test_merge_writes_the_saved_weights(saved, tmp_path, name):
    target = str(tmp_path / "hf")
    config_dir = os.path.join(saved, name, "config")
    model_merger.main(["merge", "--local_dir", _actor(saved, name), "--target_dir", target, "--config_dir", config_dir])
    trained = torch.load(os.path.join(saved, name, "trained.pt"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).state_dict()
    assert sorted(loaded) == sorted(trained)
    for key, tensor in trained.items():
        assert torch.equal(loaded[key], tensor), key
    assert os.path.isfile(os.path.join(target, TOKENIZER_FILE))


@pytest.mark.dist
def test_merge_needs_a_config_without_an_export(saved, tmp_path):
    with pytest.raises(ValueError, match="holds no huggingface/ export: pass --config_dir"):
        model_merger.merge(_actor(saved, "dcp_only"), str(tmp_path / "hf"))
    with pytest.raises(FileNotFoundError, match="no complete verl_moe checkpoint"):
        model_merger.merge(str(tmp_path), str(tmp_path / "hf"))


def test_refusal_only_for_verls_merger_on_our_folders(tmp_path):
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / ckpt.COMPLETE).write_text("{}")
    verls = tmp_path / "verls"
    verls.mkdir()
    (verls / "fsdp_config.json").write_text('{"world_size": 2}')
    merger = ["python", "-m", "verl.model_merger", "merge", "--backend", "fsdp"]
    assert model_merger.refusal([*merger, "--local_dir", str(ours)]) is not None
    assert model_merger.refusal([*merger, f"--local_dir={ours}"]) is not None
    assert model_merger.refusal([*merger, "--local_dir", str(verls)]) is None  # verl's own checkpoint
    assert model_merger.refusal([*merger, "--local_dir", str(tmp_path)]) is None  # no checkpoint at all
    assert model_merger.refusal(["python", "-m", "verl.trainer.main_ppo", "--local_dir", str(ours)]) is None
    assert model_merger.refusal(["python", "train.py"]) is None
