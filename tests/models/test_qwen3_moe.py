"""Qwen3-MoE on reference ops vs transformers' eager Qwen3MoeForCausalLM (same weights).

Tolerances (fp32):
| quantity                        | tol            |
| logits vs transformers          | max abs 1e-4   |
| parameter grads vs transformers | rel (L2) 1e-4  |
| packed vs per-sequence (ours)   | rel RMS 1e-5   |
| packed vs transformers          | max abs 1e-4   |
"""

import pytest
import torch
import verl_moe.models as vm
from tiny_models import assert_matches_transformers, hf_causal_lm, packed_inputs, randomize_norms, tiny_qwen3_moe
from verl_moe.models.layers import DenseMLP, MoeBlock
from verl_moe.ops.compare import assert_rel_rms

LENGTHS = [4, 1, 10, 2]


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["renorm", "raw"])
def test_forward_and_grads_match_transformers(norm_topk_prob):
    assert_matches_transformers(tiny_qwen3_moe(norm_topk_prob=norm_topk_prob))


def test_dense_layers_follow_mlp_only_layers_and_sparse_step():
    model = vm.build(tiny_qwen3_moe(num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=2))
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [DenseMLP, MoeBlock, DenseMLP, MoeBlock]
    assert not hasattr(model.model.layers[1].mlp, "shared_expert_gate")


def test_packed_equals_per_sequence_and_transformers():
    config = tiny_qwen3_moe()
    model = vm.build(config)
    randomize_norms(model)
    hf = hf_causal_lm(config, model)
    ids, pos, cu = packed_inputs(LENGTHS)
    with torch.no_grad():
        out = model(ids, pos, cu_seqlens=cu, output_router_logits=True)
        assert len(out.router_logits) == 2  # the dense layer has no router
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            alone = model(ids[:, s:e], pos[:, s:e]).last_hidden_state
            assert_rel_rms(f"seq {s}:{e}", alone, out.last_hidden_state[:, s:e], 1e-5)
            hf_logits = hf(input_ids=ids[:, s:e], position_ids=pos[:, s:e]).logits
            assert (model.logits(out.last_hidden_state[:, s:e]) - hf_logits).abs().max() <= 1e-4


def test_bad_inputs_raise():
    model = vm.build(tiny_qwen3_moe())
    ids, pos, _ = packed_inputs(LENGTHS)
    with pytest.raises(ValueError, match="position_ids must have shape"):
        model(ids, pos[None].expand(3, -1, -1))  # no mRoPE in Qwen3-MoE
    with pytest.raises(ValueError, match="sliding_window"):
        vm.build(tiny_qwen3_moe(use_sliding_window=True))
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        vm.build(tiny_qwen3_moe(num_key_value_heads=3))
    with pytest.raises(ValueError, match="rope_type"):
        vm.build(tiny_qwen3_moe(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}))
