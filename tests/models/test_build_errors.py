"""`build`'s inputs that used to crash deep inside: an embedding padding row outside the vocabulary,
and op choices given as a mapping (what Hydra configs carry) rather than an `OpsConfig`."""

import pytest
import torch
import verl_moe.models as vm
from omegaconf import OmegaConf
from tiny_models import tiny_qwen3_5_moe_text, tiny_qwen3_moe
from verl_moe.models.causal_lm import resolve_ops

CONFIGS = {"qwen3_5_moe": tiny_qwen3_5_moe_text, "qwen3_moe": tiny_qwen3_moe}


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("offset", [0, 5])
def test_pad_token_outside_the_vocabulary_is_named(family, offset):
    vocab = CONFIGS[family]().vocab_size
    with pytest.raises(ValueError, match=rf"pad_token_id={vocab + offset}.*vocab_size={vocab}"):
        vm.build(CONFIGS[family](pad_token_id=vocab + offset), device="meta")


@pytest.mark.parametrize("pad", [-1, -200])
def test_negative_pad_token_is_named(pad):
    with pytest.raises(ValueError, match=rf"pad_token_id={pad}.*vocab_size=128"):
        vm.build(tiny_qwen3_moe(pad_token_id=pad), device="meta")


@pytest.mark.parametrize("pad", [None, 0, 127])
def test_pad_token_inside_the_vocabulary_builds(pad):
    model = vm.build(tiny_qwen3_moe(pad_token_id=pad))
    assert model.model.embed_tokens.padding_idx == pad
    if pad is not None:
        assert torch.count_nonzero(model.model.embed_tokens.weight[pad]) == 0


def test_ops_given_as_mapping_build_as_the_dataclass():
    config = tiny_qwen3_5_moe_text()
    choice = {"router_dtype": "fp64", "norm": "torch"}
    model = vm.build(config, ops=choice)
    expected = resolve_ops(vm.OpsConfig(**choice), model.arch, torch.float32)
    assert expected.router_dtype == torch.float64  # differs from the default: the mapping is not ignored
    for module in (model.model.norm, model.model.layers[0].mlp.gate, model.model.layers[2].self_attn):
        assert module.ops == expected
    hydra = OmegaConf.create({"_target_": "verl_moe.models.OpsConfig", **choice})
    assert vm.build(config, ops=hydra).model.norm.ops == expected


def test_ops_coerce():
    ops = vm.OpsConfig(gdn="torch")
    assert vm.OpsConfig.coerce(ops) is ops
    assert vm.OpsConfig.coerce(None) == vm.OpsConfig()
    assert vm.OpsConfig.coerce({"gdn": "torch"}) == ops
    with pytest.raises(ValueError, match=r"no_such_op.*valid.*gdn.*router_dtype"):
        vm.OpsConfig.coerce({"gdn": "torch", "no_such_op": "triton"})
    with pytest.raises(ValueError, match=r"_target_.*some\.OtherConfig"):
        vm.OpsConfig.coerce({"_target_": "some.OtherConfig"})
    with pytest.raises(TypeError, match="str"):
        vm.OpsConfig.coerce("torch")


def test_build_refuses_unknown_op_keys_and_bad_values():
    with pytest.raises(ValueError, match="no_such_op"):
        vm.build(tiny_qwen3_moe(), ops={"no_such_op": "torch"})
    with pytest.raises(ValueError, match=r"OpsConfig\.norm"):
        vm.build(tiny_qwen3_moe(), ops={"norm": None})
    with pytest.raises(ValueError, match="choices"):
        vm.build(tiny_qwen3_moe(), ops={"norm": "nonexistent"})


def test_an_op_set_exact_takes_its_decoding_pair_with_it():
    """Fast mode with one op exact (gdn="exact"): the trainer's form and the rollout's decode-step form both
    exact, the pair that computes the same numbers; every other op at its default."""
    from verl_moe.ops import resolve

    model = vm.build(tiny_qwen3_5_moe_text(), ops={"gdn": "exact"})
    ops, default = model.ops, resolve_ops(vm.OpsConfig(), model.arch, torch.float32)
    assert (ops.gdn, ops.gdn_step) == (resolve("gdn", "exact"), resolve("gdn.step", "exact"))
    assert (default.gdn, default.gdn_step) != (ops.gdn, ops.gdn_step)
    for field in ("attention", "attention_decode", "attention_cached", "conv1d", "conv1d_step", "norm", "linear"):
        assert getattr(ops, field) == getattr(default, field), field
    attention = resolve_ops(vm.OpsConfig(attention="exact"), model.arch, torch.float32)
    assert attention.attention_decode == resolve("attention.decode", "exact")
    assert attention.attention_cached == resolve("attention.cached", "exact")
    assert attention.gdn_step == default.gdn_step
