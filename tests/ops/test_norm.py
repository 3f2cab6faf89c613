"""RMSNorm references vs an fp64 formula and vs transformers' Qwen3.5 / Qwen3-MoE norm modules.

Tolerances (rel RMS vs the fp64 formula):
| dtype | plain / unit offset / gated |
| fp32  | 1e-6                        |
| bf16  | 1e-2                        |
transformers' modules: bit-identical in fp32 and bf16 (same rounding points).
"""

import pytest
import torch
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm, Qwen3_5MoeRMSNormGated
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm
from verl_moe.ops import resolve
from verl_moe.ops.norm import gated_rms_norm, rms_norm
from verl_moe.ops.testing import assert_rel_rms

TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}
EPS = 1e-6


def formula(x, w, gate=None, unit_offset=False):
    """Textbook RMSNorm in fp64."""
    x, w = x.double(), w.double()
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * ((1 + w) if unit_offset else w)
    return y if gate is None else y * gate.double() * torch.sigmoid(gate.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["plain", "unit_offset", "gated"])
def test_matches_fp64_formula(dtype, variant):
    x = torch.randn(3, 5, 48) * 3
    w = torch.randn(48) * 0.2 + (0.0 if variant == "unit_offset" else 1.0)
    gate = torch.randn(3, 5, 48)
    if variant == "gated":
        out = gated_rms_norm(x.to(dtype), gate.to(dtype), w.to(dtype), EPS)
        ref = formula(x.to(dtype), w.to(dtype), gate.to(dtype))
    else:
        out = rms_norm(x.to(dtype), w.to(dtype), EPS, unit_offset=variant == "unit_offset")
        ref = formula(x.to(dtype), w.to(dtype), unit_offset=variant == "unit_offset")
    assert out.dtype == dtype
    assert_rel_rms(f"rms_norm[{variant}]", ref, out, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bit_equal_to_transformers(dtype):
    x, gate = torch.randn(4, 7, 32, dtype=dtype), torch.randn(4, 7, 32, dtype=dtype)
    q35, q3, gated = Qwen3_5MoeRMSNorm(32, EPS), Qwen3MoeRMSNorm(32, EPS), Qwen3_5MoeRMSNormGated(32, EPS)
    with torch.no_grad():
        for m in (q35, q3, gated):
            m.to(dtype).weight.copy_(torch.randn(32) * 0.3 + 1)
        assert torch.equal(rms_norm(x, q35.weight, EPS, unit_offset=True), q35(x))
        assert torch.equal(rms_norm(x, q3.weight, EPS), q3(x))
        assert torch.equal(gated_rms_norm(x, gate, gated.weight, EPS), gated(x, gate))


def test_gradients_match_fp64():
    x = torch.randn(6, 40, dtype=torch.float64, requires_grad=True)
    w = (torch.randn(40, dtype=torch.float64) * 0.1).requires_grad_()
    g = torch.randn(6, 40, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(6, 40, dtype=torch.float64)
    for gated in (False, True):
        args = (x, w, g) if gated else (x, w)
        ref = torch.autograd.grad((formula(x, w, g if gated else None, unit_offset=not gated) * dy).sum(), args)
        x32 = [a.detach().float().requires_grad_() for a in args]
        out = gated_rms_norm(x32[0], x32[2], x32[1], EPS) if gated else rms_norm(*x32, EPS, unit_offset=True)
        grads = torch.autograd.grad((out * dy.float()).sum(), x32)
        for name, r, o in zip(("dx", "dw", "dgate"), ref, grads):
            assert_rel_rms(f"{name} gated={gated}", r, o, 1e-5)


def test_dispatch_default_is_reference_on_cpu():
    fn = resolve("norm")
    x, w = torch.randn(2, 8), torch.randn(8)
    assert torch.equal(fn(x, w, EPS, unit_offset=True), rms_norm(x, w, EPS, unit_offset=True))


def test_bad_inputs_raise():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, torch.ones(7))
    with pytest.raises(ValueError, match="gate must have"):
        gated_rms_norm(x, torch.randn(2, 7), torch.ones(8))
    with pytest.raises(ValueError, match="floating point"):
        rms_norm(torch.ones(2, 8, dtype=torch.long), torch.ones(8))
    with pytest.raises(ValueError, match="unit_offset"):
        resolve("norm")(x, torch.ones(8), EPS, unit_offset=True, gate=x)
