"""MoE experts over fused weights vs a dense fp64 formula and vs transformers' Qwen3MoeExperts.

Tolerances (rel RMS):
| quantity                               | tol  |
| fp32 out vs fp64 dense formula         | 1e-6 |
| fp32 grads vs fp64                     | 1e-5 |
| bf16 weights + fp32 combine vs fp64    | 1e-2 |
| fp32 vs transformers (same weights)    | 1e-6 |
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
from verl_moe.ops.dispatch import resolve
from verl_moe.ops.testing import assert_rel_rms

N, D, E, I, TOPK = 24, 16, 6, 8, 2

# Every test runs on each implementation: the loop reference and the grouped-GEMM path.
pytestmark = pytest.mark.parametrize("impl", ["torch", "grouped"])


@pytest.fixture
def moe_experts(impl):
    return resolve("experts", impl)


def dense_formula(h, gate_up, down, idx, w):
    """Every expert on every token, combined with a dense [N, E] weight matrix (fp64)."""
    h, gate_up, down = h.double(), gate_up.double(), down.double()
    combine = torch.zeros(h.shape[0], gate_up.shape[0], dtype=torch.float64)
    combine.scatter_(1, idx, w.double())
    gate = torch.einsum("nd,eid->nei", h, gate_up[:, :I])
    up = torch.einsum("nd,eid->nei", h, gate_up[:, I:])
    y = torch.einsum("nei,edi->ned", F.silu(gate) * up, down)
    return (combine[..., None] * y).sum(1)


def inputs(dtype=torch.float32):
    h = torch.randn(N, D, dtype=dtype)
    gate_up = (torch.randn(E, 2 * I, D) * 0.3).to(dtype)
    down = (torch.randn(E, D, I) * 0.3).to(dtype)
    idx = torch.stack([torch.randperm(E)[:TOPK] for _ in range(N)])
    w = torch.softmax(torch.randn(N, TOPK), -1)
    return h, gate_up, down, idx, w


def test_fp32_matches_dense_fp64(moe_experts):
    h, gu, dn, idx, w = inputs()
    out = moe_experts(h, gu, dn, idx, w)
    assert_rel_rms("out", dense_formula(h, gu, dn, idx, w), out, 1e-6)


def test_bf16_weights_fp32_combine(moe_experts):
    h, gu, dn, idx, w = inputs(torch.bfloat16)
    out = moe_experts(h, gu, dn, idx, w)
    assert out.dtype == torch.bfloat16
    assert_rel_rms("out", dense_formula(h, gu, dn, idx, w), out, 1e-2)


def test_gradients_match_fp64(moe_experts):
    h, gu, dn, idx, w = inputs()
    dy = torch.randn(N, D)
    a64 = [t.double().requires_grad_() for t in (h, gu, dn, w)]
    ref = torch.autograd.grad((dense_formula(a64[0], a64[1], a64[2], idx, a64[3]) * dy.double()).sum(), a64)
    a32 = [t.clone().requires_grad_() for t in (h, gu, dn, w)]
    got = torch.autograd.grad((moe_experts(a32[0], a32[1], a32[2], idx, a32[3]) * dy).sum(), a32)
    for name, r, g in zip(("dhidden", "dgate_up", "ddown", "dweight"), ref, got):
        assert_rel_rms(name, r, g, 1e-5)


def test_matches_transformers_layout(moe_experts):
    """Same fused parameters give transformers' output: gate rows first, down_proj [E, D, I]."""
    hf = Qwen3MoeExperts(Qwen3MoeConfig(num_experts=E, hidden_size=D, moe_intermediate_size=I))
    h, gu, dn, idx, w = inputs()
    with torch.no_grad():
        hf.gate_up_proj.copy_(gu)
        hf.down_proj.copy_(dn)
        ref = hf(h, idx, w)
    assert_rel_rms("vs transformers", ref, moe_experts(h, gu, dn, idx, w), 1e-6)


def test_bad_inputs_raise(moe_experts):
    h, gu, dn, idx, w = inputs()
    with pytest.raises(ValueError, match="share one dtype"):
        moe_experts(h.double(), gu, dn, idx, w)
    with pytest.raises(ValueError, match=r"in \[0, E=6\)"):
        moe_experts(h, gu, dn, idx.clone().fill_(E), w)
    with pytest.raises(ValueError, match=r"down_proj must be \[E, D, I\]"):
        moe_experts(h, gu, dn.transpose(1, 2), idx, w)
    with pytest.raises(ValueError, match=r"\[N=24, TOPK\]"):
        moe_experts(h, gu, dn, idx[:-1], w[:-1])


def test_idle_experts_and_fp64(moe_experts):
    """Experts that receive no token, and fp64 (the grouped path's segment loop)."""
    h, gu, dn, _, w = inputs(torch.float64)
    idx = torch.stack([torch.tensor([1, 4]) if n % 2 else torch.tensor([4, 1]) for n in range(N)])
    assert_rel_rms("out", dense_formula(h, gu, dn, idx, w), moe_experts(h, gu, dn, idx, w), 1e-12)


def test_bitwise_deterministic(moe_experts):
    h, gu, dn, idx, w = inputs()
    assert torch.equal(moe_experts(h, gu, dn, idx, w), moe_experts(h, gu, dn, idx, w))
