"""Router: fp64 golden, transformers' routers, the router dtype, and the load-balancing loss.

Tolerances:
| quantity                                  | tol                      |
| logits / topk_weight fp32 vs fp64         | rel RMS 1e-6             |
| vs transformers' TopKRouter (fp32 model)  | rel RMS 1e-6, same ids   |
| aux loss vs textbook fp64 loop            | 1e-6 relative            |
"""

import pytest
import torch
from transformers import Qwen3_5MoeTextConfig, Qwen3MoeConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter, load_balancing_loss_func
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
from verl_moe.ops.router import load_balancing_loss, route
from verl_moe.ops.testing import assert_rel_rms, rel_rms

N, D, E, TOPK = 64, 32, 8, 2


def textbook_aux_loss(layers, top_k, num_experts, mask=None):
    """Switch/GShard: per layer E * sum_e f_e P_e, f_e = share of (valid) tokens with e in their top-k,
    P_e = mean softmax probability of e; mean over layers. Explicit fp64 loops."""
    losses = []
    for logits in layers:
        logits = logits.double()
        valid = [n for n in range(logits.shape[0]) if mask is None or mask[n]]
        f = torch.zeros(num_experts, dtype=torch.float64)
        P = torch.zeros(num_experts, dtype=torch.float64)
        for n in valid:
            p = torch.exp(logits[n] - logits[n].max())
            p = p / p.sum()
            P += p / len(valid)
            for e in sorted(range(num_experts), key=lambda e: -p[e].item())[:top_k]:
                f[e] += 1.0 / len(valid)
        losses.append(num_experts * float((f * P).sum()))
    return sum(losses) / len(losses)


@pytest.mark.parametrize("norm", [True, False], ids=["renorm", "raw"])
def test_fp32_matches_fp64(norm):
    h, w = torch.randn(N, D), torch.randn(E, D)
    logits, tw, ti = route(h, w, TOPK, norm)
    l64, tw64, ti64 = route(h.double(), w.double(), TOPK, norm, dtype=torch.float64)
    assert logits.dtype == tw.dtype == torch.float32 and ti.dtype == torch.int64
    assert_rel_rms("logits", l64, logits, 1e-6)
    assert torch.equal(ti, ti64)
    assert_rel_rms("topk_weight", tw64, tw, 1e-6)
    if norm:
        assert torch.allclose(tw.sum(-1), torch.ones(N))


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe_renorm", "qwen3_moe_raw"])
def test_matches_transformers_router(family):
    if family == "qwen3_5_moe":
        hf, norm = (
            Qwen3_5MoeTopKRouter(Qwen3_5MoeTextConfig(hidden_size=D, num_experts=E, num_experts_per_tok=TOPK)),
            True,
        )
    else:
        norm = family.endswith("renorm")
        hf = Qwen3MoeTopKRouter(
            Qwen3MoeConfig(hidden_size=D, num_experts=E, num_experts_per_tok=TOPK, norm_topk_prob=norm)
        )
    with torch.no_grad():
        hf.weight.normal_()
    h = torch.randn(N, D)
    logits, tw, ti = route(h, hf.weight, TOPK, norm)
    l_hf, tw_hf, ti_hf = hf(h)
    assert torch.equal(ti, ti_hf)
    assert_rel_rms("logits", l_hf, logits, 1e-6)
    assert_rel_rms("topk_weight", tw_hf, tw, 1e-6)


def test_router_dtype_fp32_for_bf16_model():
    """fp32 routing of bf16 activations: fp32 outputs, logits exactly the fp32 GEMM of the bf16 values,
    closer to the fp64 golden than routing in bf16."""
    h, w = torch.randn(N, D).bfloat16(), torch.randn(E, D).bfloat16()
    l32, tw32, _ = route(h, w, TOPK, True)
    l16, tw16, _ = route(h, w, TOPK, True, dtype=torch.bfloat16)
    l64, _, _ = route(h, w, TOPK, True, dtype=torch.float64)
    assert l32.dtype == tw32.dtype == torch.float32 and l16.dtype == tw16.dtype == torch.bfloat16
    assert torch.equal(l32, h.float() @ w.float().T)
    assert rel_rms(l64, l32) < 1e-6 < rel_rms(l64, l16)


def test_aux_loss_is_textbook_single_softmax():
    layers = [torch.randn(N, E) * 2 for _ in range(3)]
    ours = load_balancing_loss(layers, TOPK, E)
    assert abs(ours.item() - textbook_aux_loss(layers, TOPK, E)) < 1e-6 * textbook_aux_loss(layers, TOPK, E)
    mask = torch.rand(N) > 0.3
    masked = load_balancing_loss(layers, TOPK, E, token_mask=mask)
    assert abs(masked.item() - textbook_aux_loss(layers, TOPK, E, mask)) < 1e-6
    # one layer: transformers' function (fed raw logits, as its models record them) agrees
    hf = load_balancing_loss_func((layers[0],), E, TOPK)
    assert abs(hf.item() - load_balancing_loss(layers[0], TOPK, E).item()) < 1e-6
    # a second softmax (feeding probabilities) gives a different, flattened value
    double = load_balancing_loss(torch.softmax(layers[0], -1), TOPK, E)
    assert abs(double.item() - load_balancing_loss(layers[0], TOPK, E).item()) > 1e-3


def test_aux_loss_gradient_reaches_logits():
    logits = (torch.randn(N, E) * 2).requires_grad_()
    load_balancing_loss(logits, TOPK, E).backward()
    assert logits.grad.abs().sum() > 0


def test_bad_inputs_raise():
    h, w = torch.randn(N, D), torch.randn(E, D)
    with pytest.raises(ValueError, match="top_k"):
        route(h, w, E + 1, True)
    with pytest.raises(ValueError, match=r"\[N, D\]"):
        route(h, w[:, :-1], TOPK, True)
    with pytest.raises(ValueError, match="floating"):
        route(h, w, TOPK, True, dtype=torch.int32)
    with pytest.raises(ValueError, match="token_mask"):
        load_balancing_loss(torch.randn(N, E), TOPK, E, token_mask=torch.ones(N - 1))
    with pytest.raises(ValueError, match=r"\[N, E=8\]"):
        load_balancing_loss(torch.randn(N, E + 1), TOPK, E)
