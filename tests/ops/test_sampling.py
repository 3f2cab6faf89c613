"""The sampling op (`ops/sampling/`): the reference and the Triton kernel (interpreter on CPU, CUDA on the
GPU) against the fp64 inverse CDF of the softmax.

Two fp32 implementations round differently, so they draw different tokens wherever a row's number lands
within their rounding of a CDF boundary (at 248k tokens that is a few rows in a batch of 256): neither is
compared token for token with the other. Each is checked against fp64 instead:
- a greedy row takes the first argmax (exact: x / 1 is exact in any precision);
- a sampled row's token t holds its number u inside [CDF(t-1), CDF(t)] (fp64, fractions of the total)
  widened by delta = 8 x 2^-24 x (max|x| + V / 2048): each fp32 probability is off by at most ~4 x 2^-24
  x max|x| (x / T, x - max and exp each round), and the fp32 running total adds a rounding per block of
  >= 2048 tokens;
- its log-prob is within 2^-20 x (1 + max|x| of its row) of fp64's log-softmax (fp32 rounds x and the
  log-sum-exp at 2^-24 of their size, a few times over).
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


def _assert_valid_draws(tokens, lps, logits, temperature, greedy, uniform):
    """The module docstring's three properties, against fp64."""
    x = logits.double() / temperature.double()[:, None]
    logp = torch.log_softmax(x, -1)
    p = logp.exp()
    at = tokens[:, None]
    hi = p.cumsum(-1).gather(1, at)[:, 0]  # CDF(t)
    lo = hi - p.gather(1, at)[:, 0]  # CDF(t - 1)
    delta = 8 * 2**-24 * (x.abs().max().item() + x.shape[1] / 2048)
    assert torch.equal(tokens[greedy], x[greedy].argmax(-1))
    inside = (lo - delta <= uniform) & (uniform <= hi + delta)
    bad = (~inside & ~greedy).nonzero()[:, 0].tolist()
    assert not bad, f"rows {bad}: u={uniform[bad].tolist()} outside [{lo[bad].tolist()}, {hi[bad].tolist()}]"
    err = (lps.double() - logp.gather(1, at)[:, 0]).abs()
    assert bool((err <= 2**-20 * (1 + x.abs().amax(-1))).all()), err.max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_is_the_inverse_cdf_of_softmax(dtype):
    args = _inputs(64, 2 * CDF_BLOCK + 300, dtype)
    _assert_valid_draws(*sample_tokens_ref(*args), *args)


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
def test_triton_kernel_draws_the_fp64_inverse_cdf(dtype):
    """Interpreter on CPU: rows over several kernel blocks (V not a multiple of the block)."""
    from verl_moe.ops.sampling.kernel import sample_tokens_triton

    args = _inputs(12, 9000, dtype)
    _assert_valid_draws(*sample_tokens_triton(*args), *args)


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
def test_kernel_and_reference_draw_the_fp64_inverse_cdf_at_the_real_vocabulary():
    from verl_moe.ops.sampling.kernel import sample_tokens_triton

    """Both the kernel and the reference at the real vocabulary (one batch of a decode step)."""
    args = _inputs(256, 248320, torch.bfloat16, "cuda")
    _assert_valid_draws(*sample_tokens_triton(*args), *args)
    _assert_valid_draws(*sample_tokens_ref(*args), *args)
