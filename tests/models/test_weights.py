"""Checkpoint I/O: safetensors round trips with transformers, per-expert and vision-language layouts,
sharding, strictness, and the vLLM names for weight sync. Equalities here are bit-exact."""

import json
import re

import pytest
import torch
import transformers
import verl_moe.models as vm
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_models import (
    assert_same_state,
    randomize_norms,
    saved_keys,
    tiny_qwen3_5_moe_text,
    tiny_qwen3_5_moe_vl,
    tiny_qwen3_moe,
)

CONFIGS = {"qwen3_5_moe": tiny_qwen3_5_moe_text, "qwen3_moe": tiny_qwen3_moe}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_save_then_transformers_loads_identical(family, tmp_path):
    model = vm.build(CONFIGS[family]())
    randomize_norms(model)
    vm.save_pretrained(model, tmp_path)
    keys = saved_keys(tmp_path)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in keys and not any("gate_up_proj" in k for k in keys)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(hf).__name__ == model.spec.hf_causal_lm
    assert transformers.AutoConfig.from_pretrained(tmp_path).architectures == [model.spec.hf_causal_lm]
    assert_same_state(hf.state_dict(), model.state_dict())
    # and back through our loader
    assert_same_state(vm.from_pretrained(tmp_path).state_dict(), model.state_dict())


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_transformers_per_expert_checkpoint_loads_equal(family, tmp_path):
    import transformers

    config = CONFIGS[family]()
    hf = getattr(transformers, vm.get_spec(config.model_type).hf_causal_lm)(config)
    hf.save_pretrained(tmp_path)
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in saved_keys(tmp_path))
    assert_same_state(vm.from_pretrained(tmp_path).state_dict(), hf.state_dict())


def test_sharded_fused_bf16_checkpoint(tmp_path):
    """Our sharded save with an index; fused experts on disk also load; bf16 casts on load."""
    model = vm.build(tiny_qwen3_5_moe_text(), dtype=torch.bfloat16)
    vm.save_pretrained(model, tmp_path / "sharded", max_shard_bytes=64 * 1024)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert_same_state(vm.from_pretrained(tmp_path / "sharded", dtype=torch.bfloat16).state_dict(), model.state_dict())
    fused = tmp_path / "fused"
    fused.mkdir()
    model.config.save_pretrained(fused)
    save_file({k: v.clone() for k, v in model.state_dict().items()}, str(fused / "model.safetensors"))
    loaded = vm.from_pretrained(fused)
    assert loaded.lm_head.weight.dtype == torch.float32
    assert_same_state(loaded.state_dict(), {k: v.float() for k, v in model.state_dict().items()})


def test_vision_language_layout_loads_everything(tmp_path, caplog):
    config = tiny_qwen3_5_moe_vl()
    hf = transformers.Qwen3_5MoeForConditionalGeneration(config)
    hf.save_pretrained(tmp_path)
    assert any(k.startswith("model.visual.") for k in saved_keys(tmp_path))
    with caplog.at_level("INFO", logger="verl_moe.models.weights"):
        model = vm.from_pretrained(tmp_path)
    assert not any("skipped" in r.message for r in caplog.records)
    assert model.config.model_type == "qwen3_5_moe"
    assert_same_state(model.state_dict(), hf.state_dict())


def test_strict_loading(tmp_path):
    model = vm.build(tiny_qwen3_moe())
    vm.save_pretrained(model, tmp_path)
    state = {}
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    save_file({k: v for k, v in state.items() if k != "model.norm.weight"}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing.*model.norm.weight"):
        vm.from_pretrained(tmp_path)
    save_file(
        {k: v for k, v in state.items() if k != "model.layers.0.mlp.experts.2.up_proj.weight"},
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(ValueError, match="incomplete per-expert"):
        vm.from_pretrained(tmp_path)
    state["model.norm.weight"] = torch.ones(3)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="checkpoint shape"):
        vm.from_pretrained(tmp_path)


def test_vllm_names_split_fused_experts():
    model = vm.build(tiny_qwen3_5_moe_text(tie_word_embeddings=True))
    named = dict(vm.to_vllm_named_tensors(model))
    assert "lm_head.weight" not in named  # tied: vLLM ties it itself
    assert not any("gate_up_proj" in k or k.endswith("experts.down_proj") for k in named)
    experts = model.model.layers[1].mlp.experts
    I = model.arch.moe_intermediate_size
    for e in range(model.arch.num_experts):
        p = f"model.layers.1.mlp.experts.{e}"
        assert torch.equal(named[f"{p}.gate_proj.weight"], experts.gate_up_proj[e, :I])
        assert torch.equal(named[f"{p}.up_proj.weight"], experts.gate_up_proj[e, I:])
        assert torch.equal(named[f"{p}.down_proj.weight"], experts.down_proj[e])
    assert named["model.layers.1.mlp.experts.0.gate_proj.weight"].shape == (I, model.arch.hidden_size)
    # every other tensor passes under its transformers name; VL prefix on request
    rest = {k: v for k, v in model.state_dict().items() if ".mlp.experts." not in k and k != "lm_head.weight"}
    assert all(torch.equal(named[k], v) for k, v in rest.items())
    vl = dict(vm.to_vllm_named_tensors(model.state_dict().items(), language_model_prefix=True))
    assert "model.language_model.layers.0.linear_attn.A_log" in vl and "lm_head.weight" in vl


def test_tied_checkpoint_with_lm_head_copy_loads(tmp_path):
    model = vm.build(tiny_qwen3_moe(tie_word_embeddings=True))
    vm.save_pretrained(model, tmp_path)
    assert "lm_head.weight" not in saved_keys(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = vm.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert_same_state(loaded.state_dict(), model.state_dict())


def weight_files(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != "config.json")


@pytest.mark.parametrize("first_shard_bytes, second_shard_bytes", [(64 * 1024, None), (None, 64 * 1024)])
def test_resave_replaces_every_old_weight_file(tmp_path, first_shard_bytes, second_shard_bytes):
    """A save over an earlier sharded (or single-file) save and a stray pytorch_model.bin leaves only
    the new files; we and transformers both load the new weights."""

    def save(model, shard_bytes):
        vm.save_pretrained(model, tmp_path, **({} if shard_bytes is None else {"max_shard_bytes": shard_bytes}))

    old, new = vm.build(tiny_qwen3_moe()), vm.build(tiny_qwen3_moe())
    save(old, first_shard_bytes)
    torch.save({}, tmp_path / "pytorch_model.bin")
    save(new, second_shard_bytes)
    files = weight_files(tmp_path)
    if second_shard_bytes is None:
        assert files == ["model.safetensors"]
    else:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert files == sorted({*index["weight_map"].values(), "model.safetensors.index.json"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert_same_state(hf.state_dict(), new.state_dict())
    assert_same_state(vm.from_pretrained(tmp_path).state_dict(), new.state_dict())


def test_single_file_beside_stale_index_loads_like_transformers(tmp_path):
    """A folder holding model.safetensors and an index with its shards (written by another tool):
    transformers reads the single file; so do we."""
    old, new = vm.build(tiny_qwen3_moe()), vm.build(tiny_qwen3_moe())
    vm.save_pretrained(old, tmp_path, max_shard_bytes=64 * 1024)
    vm.save_pretrained(new, tmp_path / "single")
    (tmp_path / "single" / "model.safetensors").rename(tmp_path / "model.safetensors")
    assert "model.safetensors.index.json" in weight_files(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert_same_state(hf.state_dict(), new.state_dict())
    assert_same_state(vm.from_pretrained(tmp_path).state_dict(), new.state_dict())


def test_one_key_in_two_files_raises(tmp_path):
    model = vm.build(tiny_qwen3_moe())
    vm.save_pretrained(model, tmp_path, max_shard_bytes=64 * 1024)
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    first = index["weight_map"]["model.norm.weight"]
    save_file({"model.norm.weight": torch.zeros(64)}, str(tmp_path / "extra.safetensors"))
    index["weight_map"]["extra.marker"] = "extra.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"model\.norm\.weight.*({first}.*extra|extra.*{first})"):
        vm.from_pretrained(tmp_path)


def test_index_naming_a_missing_shard_raises(tmp_path):
    vm.save_pretrained(vm.build(tiny_qwen3_moe()), tmp_path, max_shard_bytes=64 * 1024)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        vm.from_pretrained(tmp_path)


def test_missing_folder_config_or_weights_name_the_path(tmp_path):
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        vm.from_pretrained(missing)
    tiny_qwen3_moe().save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=rf"model\.safetensors.*{tmp_path}"):
        vm.from_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=rf"config\.json.*{tmp_path}"):
        vm.from_pretrained(tmp_path)


@pytest.mark.parametrize("keep", [0, 7, 0.5, -1])
def test_truncated_safetensors_names_the_file(tmp_path, keep):
    vm.save_pretrained(vm.build(tiny_qwen3_moe()), tmp_path)
    file = tmp_path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep % len(data)])
    with pytest.raises(ValueError, match=rf"{file}"):
        vm.from_pretrained(tmp_path)


def test_per_expert_tensor_of_wrong_shape_is_named(tmp_path):
    model = vm.build(tiny_qwen3_moe())
    vm.save_pretrained(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    key = "model.layers.0.mlp.experts.3.gate_proj.weight"
    expected = tuple(state[key].shape)
    state[key] = torch.zeros(expected[0] + 1, expected[1])
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{re.escape(key)}.*\({expected[0]}, {expected[1]}\)"):
        vm.from_pretrained(tmp_path)


def test_fused_and_per_expert_copies_of_one_tensor_raise(tmp_path):
    """A checkpoint holding a layer's experts both fused and per expert: refused, not last-wins."""
    model = vm.build(tiny_qwen3_moe())
    vm.save_pretrained(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    state["model.layers.0.mlp.experts.down_proj"] = model.model.layers[0].mlp.experts.down_proj.detach().clone()
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.down_proj"):
        vm.from_pretrained(tmp_path)
