"""Qwen3.5-MoE on reference ops vs transformers' eager Qwen3_5MoeForCausalLM (same weights).

Tolerances (fp32):
| quantity                                   | tol                    |
| logits vs transformers                     | max abs 1e-4           |
| parameter grads vs transformers            | rel (L2) 1e-4          |
| packed vs per-sequence (ours)              | rel RMS 1e-5           |
| packed vs transformers one sequence a time | max abs 1e-4           |
| fp32 model vs the same weights in fp64     | rel RMS 1e-5           |
transformers 5.10.4's torch GatedDeltaNet ignores packing, so it is run one sequence at a time.
"""

import pytest
import torch
import verl_moe.models as vm
from tiny_models import (
    assert_matches_transformers,
    hf_causal_lm,
    inputs,
    packed_inputs,
    randomize_norms,
    tiny_qwen3_5_moe_text,
)
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func
from verl_moe.ops.compare import assert_rel_rms
from verl_moe.ops.router import load_balancing_loss

LENGTHS = [5, 1, 9, 3]


@pytest.fixture(scope="module")
def pair():
    config = tiny_qwen3_5_moe_text()
    model = vm.build(config)
    randomize_norms(model)
    return model, hf_causal_lm(config, model)


def test_forward_and_grads_match_transformers():
    assert_matches_transformers(tiny_qwen3_5_moe_text())


def test_tied_embeddings_match_transformers():
    config = tiny_qwen3_5_moe_text(tie_word_embeddings=True)
    model = vm.build(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert_matches_transformers(config, B=1, T=8)


def test_mrope_positions_match_transformers(pair):
    model, hf = pair
    ids, _ = inputs(2, 10)
    t = torch.arange(10)
    pos = torch.stack([t, t // 2 + 3, t % 4])[:, None].expand(3, 2, 10).contiguous()
    with torch.no_grad():
        diff = model.logits(model(ids, pos).last_hidden_state) - hf(input_ids=ids, position_ids=pos).logits
    assert diff.abs().max() <= 1e-4


def test_packed_equals_per_sequence_and_transformers(pair):
    model, hf = pair
    ids, pos, cu = packed_inputs(LENGTHS)
    with torch.no_grad():
        packed = model(ids, pos, cu_seqlens=cu).last_hidden_state
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            alone = model(ids[:, s:e], pos[:, s:e]).last_hidden_state
            assert_rel_rms(f"seq {s}:{e}", alone, packed[:, s:e], 1e-5)
            hf_logits = hf(input_ids=ids[:, s:e], position_ids=pos[:, s:e]).logits
            assert (model.logits(packed[:, s:e]) - hf_logits).abs().max() <= 1e-4


def test_router_logits_and_single_softmax_aux_loss(pair):
    """transformers records raw gate logits (index 0 of the router) and applies one softmax in
    load_balancing_loss_func: its aux loss over the pooled layers equals ours on the pooled logits,
    and differs from the value a second softmax would give."""
    model, hf = pair
    ids, pos = inputs(2, 12)
    with torch.no_grad():
        ours = model(ids, pos, output_router_logits=True).router_logits
        hf_out = hf(input_ids=ids, position_ids=pos, output_router_logits=True)
    assert len(ours) == 3 and all(r.dtype == torch.float32 for r in ours)
    for a, b in zip(ours, hf_out.router_logits):
        assert_rel_rms("router logits", b, a, 1e-6)
    E, K = model.arch.num_experts, model.arch.num_experts_per_tok
    pooled = load_balancing_loss(torch.cat(ours), K, E)
    assert abs(hf_out.aux_loss.item() - pooled.item()) < 1e-6
    double = load_balancing_loss_func(tuple(torch.softmax(r, -1) for r in ours), E, K)
    assert abs(double.item() - pooled.item()) > 1e-4


def test_router_dtype_option():
    config = tiny_qwen3_5_moe_text()
    ids, pos = inputs(1, 6)
    for router_dtype, model_dtype, expect in [
        ("fp64", torch.float32, torch.float64),
        ("model", torch.float32, torch.float32),
        ("fp32", torch.bfloat16, torch.float32),
        ("model", torch.bfloat16, torch.bfloat16),
    ]:
        model = vm.build(config, dtype=model_dtype, ops=vm.OpsConfig(router_dtype=router_dtype))
        out = model(ids, pos, output_router_logits=True)
        assert out.last_hidden_state.dtype == model_dtype
        assert all(r.dtype == expect for r in out.router_logits), (router_dtype, model_dtype)


def test_fp32_close_to_fp64_golden():
    config = tiny_qwen3_5_moe_text()
    model = vm.build(config)
    randomize_norms(model)
    golden = vm.build(config, dtype=torch.float64, ops=vm.OpsConfig(router_dtype="fp64"))
    golden.load_state_dict(model.state_dict())
    ids, pos, cu = packed_inputs(LENGTHS)
    with torch.no_grad():
        out = model(ids, pos, cu_seqlens=cu).last_hidden_state
        ref = golden(ids, pos, cu_seqlens=cu).last_hidden_state
    assert ref.dtype == torch.float64
    assert_rel_rms("fp32 vs fp64", ref, out, 1e-5)


def test_bad_inputs_raise(pair):
    model, _ = pair
    ids, pos, cu = packed_inputs(LENGTHS)
    with pytest.raises(ValueError, match="non-decreasing"):
        model(ids, pos, cu_seqlens=torch.tensor([0, 9, 5, 18], dtype=torch.int32))
    with pytest.raises(ValueError, match="B == 1"):
        model(ids.expand(2, -1), pos.expand(2, -1), cu_seqlens=cu)
    with pytest.raises(ValueError, match="int32/int64"):
        model(ids, pos.float())
    with pytest.raises(ValueError, match="position_ids must have shape"):
        model(ids, pos[:, :-1])
    with pytest.raises(ValueError, match="multiple of linear_num_key_heads"):
        vm.build(tiny_qwen3_5_moe_text(linear_num_key_heads=3, linear_num_value_heads=4))
    with pytest.raises(ValueError, match="unknown layer type"):
        vm.build(tiny_qwen3_5_moe_text(layer_types=["linear_attention", "sliding_attention", "full_attention"]))
    with pytest.raises(ValueError, match="router_dtype"):
        vm.OpsConfig(router_dtype="fp8")
    with pytest.raises(ValueError, match="no implementation"):
        vm.build(tiny_qwen3_5_moe_text(), ops=vm.OpsConfig(norm="nonexistent"))


def test_fp64_model_takes_torch_ops_on_accelerators(monkeypatch):
    # The align tool's fp64 reference once picked the Triton GDN kernels ("auto" on a GPU),
    # which refuse fp64 inputs. An fp64 model resolves "auto" to each op's torch code, even when
    # VERL_MOE_OPS names a kernel; a 16/32-bit model keeps the accelerator defaults.
    from verl_moe.models.layers import ResolvedOps
    from verl_moe.ops import device
    from verl_moe.ops.experts.reference import moe_experts_ref
    from verl_moe.ops.gdn.chunk import chunk_gated_delta_rule
    from verl_moe.ops.gdn.reference import chunk_gated_delta_rule_ref

    def resolved(model):
        return next(m.ops for m in model.modules() if isinstance(getattr(m, "ops", None), ResolvedOps))

    monkeypatch.setattr(device, "is_accelerator", lambda: True)
    monkeypatch.setenv("VERL_MOE_OPS", "gdn=triton")
    fp64 = resolved(vm.build(tiny_qwen3_5_moe_text(), dtype=torch.float64))
    fp32 = resolved(vm.build(tiny_qwen3_5_moe_text(), dtype=torch.float32))
    assert fp64.gdn is chunk_gated_delta_rule_ref and fp64.experts is moe_experts_ref
    assert fp32.gdn is chunk_gated_delta_rule and fp32.experts is not moe_experts_ref
    # flash attention (attention's accelerator default) takes 16-bit inputs: fp32 keeps the torch code
    from verl_moe.ops.attention.reference import causal_attention_ref

    assert fp32.attention is causal_attention_ref
