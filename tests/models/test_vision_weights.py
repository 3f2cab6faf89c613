"""Vision-language checkpoints: our save loads in transformers' Qwen3_5MoeForConditionalGeneration
and transformers' save loads in ours, every tensor (`model.visual.*` included) bit-exact; sharded
and tied layouts; MTP tensors skipped with one log line; vLLM names keep the VL prefixes."""

import torch
import transformers
import verl_moe.models as vm
from safetensors import safe_open
from safetensors.torch import save_file
from test_vision import mm_token_types, randomize, sample, tiny_vl_config
from tiny_models import assert_same_state, saved_keys


def test_our_save_loads_in_transformers(tmp_path):
    model = vm.build(tiny_vl_config())
    randomize(model)
    vm.save_pretrained(model, tmp_path)
    keys = saved_keys(tmp_path)
    assert "model.visual.merger.linear_fc2.weight" in keys
    assert "model.language_model.layers.0.mlp.experts.3.up_proj.weight" in keys
    hf, info = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path, output_loading_info=True)
    assert type(hf).__name__ == "Qwen3_5MoeForConditionalGeneration"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert_same_state(hf.state_dict(), model.state_dict())
    # the saved config is the model's: transformers computes the same image positions from it
    gen = torch.Generator().manual_seed(0)
    ids, _, _ = sample(gen, images=[(1, 4, 6)])
    grid = torch.tensor([[1, 4, 6]])
    assert torch.equal(
        model.rope_index(ids[None], grid)[0], hf.model.get_rope_index(ids[None], mm_token_types(ids[None]), grid)[0]
    )


def test_transformers_save_loads_in_ours(tmp_path, caplog):
    config = tiny_vl_config()
    hf = transformers.Qwen3_5MoeForConditionalGeneration(config)
    hf.save_pretrained(tmp_path)
    state = {}
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    state["mtp.fc.weight"] = torch.zeros(2, 2)  # real checkpoints carry MTP weights; transformers ignores them
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level("INFO", logger="verl_moe.models.weights"):
        model = vm.from_pretrained(tmp_path)
    assert isinstance(model, vm.MoeVisionLM)
    assert [r.message for r in caplog.records if "skipped" in r.message] == [
        "verl_moe: skipped 1 checkpoint tensors outside the model or tied (mtp.fc)"
    ]
    assert_same_state(model.state_dict(), hf.state_dict())


def test_sharded_and_tied_round_trip(tmp_path):
    model = vm.build(tiny_vl_config(), dtype=torch.bfloat16)
    vm.save_pretrained(model, tmp_path / "sharded", max_shard_bytes=64 * 1024)
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    assert_same_state(vm.from_pretrained(tmp_path / "sharded", dtype=torch.bfloat16).state_dict(), model.state_dict())

    config = tiny_vl_config(tie_word_embeddings=True)
    config.tie_word_embeddings = True
    tied = vm.build(config)
    assert tied.lm_head.weight is tied.model.language_model.embed_tokens.weight
    vm.save_pretrained(tied, tmp_path / "tied")
    assert "lm_head.weight" not in saved_keys(tmp_path / "tied")
    loaded = vm.from_pretrained(tmp_path / "tied")
    assert loaded.lm_head.weight is loaded.model.language_model.embed_tokens.weight
    assert_same_state(loaded.state_dict(), tied.state_dict())


def test_vllm_names_keep_the_vision_language_prefixes():
    model = vm.build(tiny_vl_config())
    named = dict(vm.to_vllm_named_tensors(model, language_model_prefix=True))
    assert "model.language_model.layers.1.mlp.experts.2.down_proj.weight" in named
    assert "model.visual.blocks.0.attn.qkv.weight" in named and "lm_head.weight" in named
    assert not any(k.startswith("model.language_model.language_model") for k in named)


def test_text_only_build_loads_the_decoder_of_a_vision_language_checkpoint(tmp_path):
    """`text_only=True` (what the engines build until they feed images): a MoeCausalLM from the VL
    config whose weights are the checkpoint's `model.language_model.*` and `lm_head`, so on text it
    gives the full VL model's hidden states bit for bit."""
    model = vm.build(tiny_vl_config())
    randomize(model)
    vm.save_pretrained(model, tmp_path)
    assert isinstance(vm.build(tiny_vl_config(), device="meta", text_only=True), vm.MoeCausalLM)
    text = vm.from_pretrained(tmp_path, text_only=True)
    assert isinstance(text, vm.MoeCausalLM)
    assert not any(k.startswith("model.visual.") for k in text.state_dict())
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(3))
    pos, _ = model.rope_index(ids)
    with torch.no_grad():
        assert torch.equal(text(ids, pos).last_hidden_state, model(ids, pos).last_hidden_state)


def test_compute_dtype_picks_the_ops(monkeypatch):
    """An fp32 model takes torch attention whatever VERL_MOE_OPS says (flash takes 16-bit inputs only);
    under mixed precision (fp32 master weights, bf16 compute) the ops are chosen for bf16."""
    from verl_moe.ops.attention.flex import causal_attention_flex
    from verl_moe.ops.attention.reference import causal_attention_ref

    monkeypatch.setenv("VERL_MOE_OPS", "attention=flex")
    config = tiny_vl_config().text_config

    def attention_of(model):
        return next(m.ops.attention for m in model.modules() if hasattr(m, "ops") and hasattr(m.ops, "attention"))

    assert attention_of(vm.build(config, device="meta")) is causal_attention_ref
    assert attention_of(vm.build(config, device="meta", compute_dtype=torch.bfloat16)) is causal_attention_flex
