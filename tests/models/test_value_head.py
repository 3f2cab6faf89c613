"""The value model (the causal LM spec with its lm_head swapped for `score`) against transformers' value model
of the same weights: `Qwen3MoeForTokenClassification` with one label, and for Qwen3.5-MoE (no token classifier
in transformers) its decoder plus a Linear(D, 1) head, as transformers' generic token classifier builds it.

Tolerances (fp32):
| quantity                                       | tol            |
| values vs transformers (rows and packed)       | max abs 1e-5   |
| parameter grads of a value loss vs transformers| rel (L2) 1e-4  |
transformers 5.10.4's torch GatedDeltaNet ignores packing: its reference runs one sequence at a time.
"""

from __future__ import annotations

import pytest
import torch
import verl_moe.models as vm
from hf_value_model import hf_value_model, hf_values
from tiny_models import inputs, packed_inputs, randomize_norms, tiny_qwen3_5_moe_text, tiny_qwen3_moe
from verl_moe.models.value_head import (
    add_value_head,
    is_value_model,
    save_value_pretrained,
    token_values,
    value_from_pretrained,
)

CONFIGS = {"qwen3_5_moe_text": tiny_qwen3_5_moe_text, "qwen3_moe": tiny_qwen3_moe}
LENGTHS = [5, 1, 9, 3]


def _value_model(config, seed: int = 0) -> vm.MoeCausalLM:
    torch.manual_seed(seed)
    model = vm.build(config)
    randomize_norms(model)
    add_value_head(model, torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        model.score.bias.fill_(0.25)  # a bias the test sees (transformers' init leaves it 0)
    return model


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_values_and_grads_match_transformers(family):
    config = CONFIGS[family]()
    model = _value_model(config)
    assert is_value_model(model) and not hasattr(model, "lm_head")
    assert set(model.state_dict()) == set(hf_value_model(config).state_dict())
    hf = hf_value_model(config, model.state_dict())
    ids, pos = inputs(2, 12)
    ours = token_values(model, model(ids, pos).last_hidden_state)
    ref = hf_values(hf, ids, pos)
    assert ours.dtype == torch.float32 and ours.shape == (2, 12)
    assert (ours - ref).abs().max().item() <= 1e-5
    target = torch.randn(2, 12, generator=torch.Generator().manual_seed(3))
    ((ours - target) ** 2).mean().backward()
    ((ref - target) ** 2).mean().backward()
    hf_params = dict(hf.named_parameters())
    for name, p in model.named_parameters():
        g, g_hf = p.grad, hf_params[name].grad
        assert g is not None and g_hf is not None, name
        assert (g - g_hf).norm() <= 1e-4 * g_hf.norm() + 1e-12, name


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_packed_values_match_transformers_per_sequence(family):
    config = CONFIGS[family]()
    model = _value_model(config)
    hf = hf_value_model(config, model.state_dict())
    ids, pos, cu = packed_inputs(LENGTHS)
    with torch.no_grad():
        ours = token_values(model, model(ids, pos, cu_seqlens=cu).last_hidden_state)[0]
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
            ref = hf_values(hf, ids[:, start:end], pos[:, start:end])[0]
            assert (ours[start:end] - ref).abs().max().item() <= 1e-5, (start, end)


@pytest.mark.parametrize("tied", [False, True])
def test_from_causal_checkpoint_keeps_the_decoder_and_draws_the_head(tmp_path, tied):
    config = tiny_qwen3_5_moe_text(tie_word_embeddings=tied)
    torch.manual_seed(0)
    causal = vm.build(config)
    randomize_norms(causal)
    vm.save_pretrained(causal, tmp_path)
    value = value_from_pretrained(tmp_path, config, seed=7)
    again = value_from_pretrained(tmp_path, config, seed=7)
    other = value_from_pretrained(tmp_path, config, seed=8)
    assert is_value_model(value) and not value.arch.tie_word_embeddings
    decoder = {k: v for k, v in causal.state_dict().items() if k != "lm_head.weight"}
    assert set(value.state_dict()) == set(decoder) | {"score.weight", "score.bias"}
    for name, tensor in decoder.items():
        assert torch.equal(value.state_dict()[name], tensor), name
    assert torch.equal(value.score.weight, again.score.weight)
    assert not torch.equal(value.score.weight, other.score.weight)
    assert torch.count_nonzero(value.score.bias) == 0
    # transformers' head init: normal(0, initializer_range)
    assert 0.5 < value.score.weight.std().item() / config.initializer_range < 1.5


def test_value_checkpoint_round_trips_with_transformers(tmp_path):
    """transformers' Qwen3MoeForTokenClassification saved -> ours loads it whole (head included); ours saved
    -> transformers' AutoModelForTokenClassification loads it and computes the same values."""
    from transformers import AutoModelForTokenClassification

    config = tiny_qwen3_moe()
    hf = hf_value_model(config, _value_model(config).state_dict())
    hf.save_pretrained(tmp_path / "hf")
    ours = value_from_pretrained(tmp_path / "hf", config, seed=0)
    for name, tensor in hf.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name
    save_value_pretrained(ours, tmp_path / "ours")
    back = AutoModelForTokenClassification.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    assert back.config.num_labels == 1
    ids, pos = inputs(2, 8)
    with torch.no_grad():
        diff = token_values(ours, ours(ids, pos).last_hidden_state) - hf_values(back, ids, pos)
    assert diff.abs().max().item() <= 1e-5


def test_value_head_refusals():
    model = _value_model(tiny_qwen3_moe())
    with pytest.raises(ValueError, match="already has a value head"):
        add_value_head(model)
    mtp = vm.build(tiny_qwen3_5_moe_text(mtp_num_hidden_layers=1))
    with pytest.raises(ValueError, match="takes no MTP layers"):
        add_value_head(mtp)
