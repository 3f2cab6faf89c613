"""Checkpoint I/O of Qwen3.5's MTP tensors (`mtp.*`): strict loading, a bitwise load -> save round trip under
the checkpoint's own names, transformers reading our save, and the vLLM names for weight sync."""

import json

import pytest
import torch
import transformers
import verl_moe.models as vm
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_models import assert_same_state, save_checkpoint_with_mtp, saved_keys, tiny_qwen3_5_moe_text


@pytest.fixture
def mtp_folder(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    mtp = save_checkpoint_with_mtp(tiny_qwen3_5_moe_text(), folder)
    return folder, mtp


def read_all(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            out |= {k: fh.get_tensor(k) for k in fh.keys()}
    return out


def test_load_save_round_trip_is_bitwise(mtp_folder, tmp_path):
    folder, mtp = mtp_folder
    model = vm.from_pretrained(folder)
    assert model.arch.mtp_num_hidden_layers == 1
    # every checkpoint tensor consumed: the model's mtp.* state is the checkpoint's, experts fused
    assert torch.equal(model.state_dict()["mtp.fc.weight"], mtp["mtp.fc.weight"])
    vm.save_pretrained(model, tmp_path / "out")
    saved = read_all(tmp_path / "out")
    assert {k for k in saved if k.startswith("mtp.")} == set(mtp)  # per expert, the checkpoint's names
    for name, tensor in mtp.items():
        assert saved[name].dtype == tensor.dtype and torch.equal(saved[name], tensor), name
    original = read_all(folder)
    assert sorted(saved) == sorted(original)
    assert all(torch.equal(saved[k], original[k]) for k in original)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    assert_same_state(vm.from_pretrained(tmp_path / "out").state_dict(), model.state_dict())
    # transformers reads our save and drops the MTP tensors, as it does for released checkpoints
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert_same_state(hf.state_dict(), {k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")})


def rewrite_mtp_shard(folder, change) -> None:
    shard = folder / "model-00002-of-00002.safetensors"
    tensors = read_all_file(shard)
    change(tensors)
    save_file(tensors, str(shard))
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard.name} | dict.fromkeys(
        tensors, shard.name
    )
    index_file.write_text(json.dumps(index))


def read_all_file(file) -> dict[str, torch.Tensor]:
    with safe_open(str(file), "pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}


def test_missing_mtp_tensor_raises(mtp_folder):
    folder, _ = mtp_folder
    rewrite_mtp_shard(folder, lambda t: t.pop("mtp.pre_fc_norm_hidden.weight"))
    with pytest.raises(ValueError, match=r"missing \['mtp\.pre_fc_norm_hidden\.weight'\].*mtp_num_hidden_layers=0"):
        vm.from_pretrained(folder)


def test_unexpected_mtp_tensor_raises(mtp_folder):
    folder, _ = mtp_folder
    rewrite_mtp_shard(folder, lambda t: t.update({"mtp.layers.1.input_layernorm.weight": torch.zeros(64)}))
    with pytest.raises(ValueError, match=r"unexpected \['mtp\.layers\.1\.input_layernorm\.weight'\]"):
        vm.from_pretrained(folder)


def test_checkpoint_without_mtp_tensors_names_the_fix(tmp_path):
    """transformers saves a Qwen3.5 model without its MTP tensors but keeps mtp_num_hidden_layers."""
    config = tiny_qwen3_5_moe_text(mtp_num_hidden_layers=1)
    transformers.Qwen3_5MoeForCausalLM(config).save_pretrained(tmp_path)
    assert not any(k.startswith("mtp.") for k in saved_keys(tmp_path))
    with pytest.raises(ValueError, match=r"missing \['mtp\.fc\.weight'.*load.* with mtp_num_hidden_layers=0"):
        vm.from_pretrained(tmp_path)


def test_config_without_mtp_layers_skips_mtp_tensors(mtp_folder, caplog):
    folder, _ = mtp_folder
    raw = json.loads((folder / "config.json").read_text())
    raw["mtp_num_hidden_layers"] = 0
    (folder / "config.json").write_text(json.dumps(raw))
    with caplog.at_level("INFO", logger="verl_moe.models.weights"):
        model = vm.from_pretrained(folder)
    assert not hasattr(model, "mtp")
    assert any("skipped" in r.message and "mtp.fc" in r.message for r in caplog.records)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert_same_state(hf.state_dict(), model.state_dict())


def test_vllm_names_carry_mtp_per_expert(mtp_folder):
    folder, mtp = mtp_folder
    named = dict(vm.to_vllm_named_tensors(vm.from_pretrained(folder)))
    assert {k for k in named if k.startswith("mtp.")} == set(mtp)
    assert all(torch.equal(named[k], v) for k, v in mtp.items())
