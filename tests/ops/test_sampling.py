"""The sampling op (`ops/sampling/`): the reference against the textbook inverse CDF (one fp64 cumsum of
softmax over the whole row) and log-softmax, the Triton kernel (interpreter on CPU, CUDA on the GPU)
against the reference.

Tolerances: tokens equal (a draw changes only when its number lands within ~1e-7 of a CDF boundary:
fixed seeds make the tests deterministic); log-probs of the drawn token within 1e-6 x (1 + |log-prob|):
fp32 rounds x / T and the log-sum-exp at ~6e-8 of their size, log-probs here reach -30.
"""

from __future__ import annotations

import pytest
import torch
from verl_moe.ops.sampling import inverse_cdf, sample_tokens_ref
from verl_moe.ops.sampling.reference import CDF_BLOCK


def _inputs(N, V, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(N, V, generator=gen)).to(dtype)
    temperature = 0.5 + torch.rand(N, generator=gen)
    greedy = torch.arange(N) % 4 == 0
    temperature[greedy] = 1.0
    uniform = torch.rand(N, generator=gen, dtype=torch.float64)
    uniform[1:4] = torch.tensor([0.0, 1.0 - 2**-53, 1e-12], dtype=torch.float64)
    return [t.to(device) for t in (logits, temperature, greedy, uniform)]


def _assert_close(lps, ref):
    err = (lps.double() - ref.double()).abs()
    assert bool((err <= 1e-6 * (1 + ref.double().abs())).all()), err.max().item()


def _textbook(logits, temperature, greedy, uniform):
    x = logits.double() / temperature.double()[:, None]
    cdf = torch.softmax(x, -1).cumsum(-1)
    target = torch.minimum(uniform[:, None] * cdf[:, -1:], torch.nextafter(cdf[:, -1:], torch.zeros(1).double()))
    drawn = torch.searchsorted(cdf, target, right=True)[:, 0].clamp(max=logits.shape[1] - 1)
    tokens = torch.where(greedy, x.argmax(-1), drawn)
    return tokens, torch.log_softmax(x, -1).gather(-1, tokens[:, None])[:, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_is_the_inverse_cdf_of_softmax(dtype):
    args = _inputs(64, 2 * CDF_BLOCK + 300, dtype)
    tokens, lps = sample_tokens_ref(*args)
    ref_tokens, ref_lps = _textbook(*args)
    assert torch.equal(tokens, ref_tokens)
    _assert_close(lps, ref_lps)


def test_two_level_cdf_skips_masked_tokens():
    """Zero-weight tokens (masked), also across a block edge, are never drawn; the pick equals one fp64
    scan of the row."""
    gen = torch.Generator().manual_seed(1)
    N, V = 64, 2 * CDF_BLOCK + 300
    probs = torch.softmax(3 * torch.randn(N, V, generator=gen), -1)
    probs[:, 100:1500] *= torch.rand(N, 1400, generator=gen) > 0.5
    uniform = torch.rand(N, generator=gen, dtype=torch.float64)
    cdf = probs.double().cumsum(-1)
    target = torch.minimum(uniform[:, None] * cdf[:, -1:], torch.nextafter(cdf[:, -1:], torch.zeros(1).double()))
    expect = torch.searchsorted(cdf, target, right=True)[:, 0]
    drawn = inverse_cdf(probs, uniform)
    assert torch.equal(drawn, expect)
    assert bool((probs.gather(1, drawn[:, None]) > 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_kernel_equals_reference(dtype):
    """Interpreter on CPU: rows over several kernel blocks (V not a multiple of the block)."""
    from verl_moe.ops.sampling.kernel import sample_tokens_triton

    args = _inputs(12, 9000, dtype)
    tokens, lps = sample_tokens_triton(*args)
    ref_tokens, ref_lps = sample_tokens_ref(*args)
    assert torch.equal(tokens, ref_tokens)
    _assert_close(lps, ref_lps)


def test_bad_inputs_raise_one_line():
    logits, temperature, greedy, uniform = _inputs(4, 50)
    with pytest.raises(ValueError, match="uniform must be"):
        sample_tokens_ref(logits, temperature, greedy, uniform.float())
    with pytest.raises(ValueError, match="greedy must be"):
        sample_tokens_ref(logits, temperature, greedy[:2], uniform)
    with pytest.raises(ValueError, match="logits must be"):
        sample_tokens_ref(logits[0], temperature, greedy, uniform)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_kernel_equals_reference_at_the_real_vocabulary():
    from verl_moe.ops.sampling.kernel import sample_tokens_triton

    args = _inputs(256, 248320, torch.bfloat16, "cuda")
    tokens, lps = sample_tokens_triton(*args)
    ref_tokens, ref_lps = sample_tokens_ref(*args)
    assert torch.equal(tokens, ref_tokens)
    _assert_close(lps, ref_lps)
