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
    size = x.masked_fill(x.isinf(), 0).abs()  # masked (-inf) tokens have weight 0 and no rounding
    delta = 8 * 2**-24 * (size.max().item() + x.shape[1] / 2048)
    assert torch.equal(tokens[greedy], x[greedy].argmax(-1))
    inside = (lo - delta <= uniform) & (uniform <= hi + delta)
    bad = (~inside & ~greedy).nonzero()[:, 0].tolist()
    assert not bad, f"rows {bad}: u={uniform[bad].tolist()} outside [{lo[bad].tolist()}, {hi[bad].tolist()}]"
    err = (lps.double() - logp.gather(1, at)[:, 0]).abs()
    assert bool((err <= 2**-20 * (1 + size.amax(-1))).all()), err.max().item()


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
@pytest.mark.parametrize("chunk", [256, 8192])
def test_triton_kernel_draws_the_fp64_inverse_cdf(dtype, chunk):
    """Interpreter on CPU: rows over many chunks (36 of 256 tokens, the last one partial) and over two of
    the default size."""
    from verl_moe.ops.sampling.kernel import sample_tokens_triton

    args = _inputs(12, 9000, dtype)
    _assert_valid_draws(*sample_tokens_triton(*args, chunk=chunk), *args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_exact_device_form_draws_the_fp64_inverse_cdf(dtype):
    """Exact mode's draw on devices (interpreter on CPU): the kernel's token, its log-prob by the exact head's
    computation, logit x fp32(1 / T) - the head's normaliser, bitwise; valid draws against fp64."""
    from verl_moe.ops.logprob.exact_kernel import scaled_logsumexp_triton
    from verl_moe.ops.sampling.exact import _sample_by_kernel

    args = _inputs(12, 9000, dtype)
    tokens, lps = _sample_by_kernel(*args)
    _assert_valid_draws(tokens, lps, *args)
    logits, inv_t = args[0].float(), 1.0 / args[1].float()
    head = logits.gather(-1, tokens[:, None])[:, 0] * inv_t - scaled_logsumexp_triton(logits, inv_t)
    assert torch.equal(lps, head)


def test_triton_kernel_skips_masked_chunks_and_finds_the_first_maximum():
    """Whole chunks of -inf (the first one among them) are never drawn and carry weight 0; a maximum
    repeated in two chunks gives a greedy row the first."""
    from verl_moe.ops.sampling.kernel import sample_tokens_triton

    logits, temperature, greedy, uniform = _inputs(16, 2000)
    logits[:, :256] = float("-inf")
    logits[:, 700:900] = float("-inf")
    logits[:, 1500] = logits[:, 1900] = 40.0
    logits[1::2, 1500] = logits[1::2, 1900] = float("-inf")  # odd rows: no repeated maximum
    uniform[5] = 0.0  # the first token of weight: right after the masked first chunk
    tokens, lps = sample_tokens_triton(logits, temperature, greedy, uniform, chunk=256)
    _assert_valid_draws(tokens, lps, logits, temperature, greedy, uniform)
    assert not bool(((tokens < 256) | ((tokens >= 700) & (tokens < 900))).any())
    assert bool((tokens[greedy] == 1500).all())  # greedy rows are the even rows 0, 4, 8, 12


def test_triton_kernel_refuses_a_chunk_that_is_not_a_power_of_two():
    from verl_moe.ops.sampling.kernel import sample_tokens_triton

    with pytest.raises(ValueError, match="chunk must be a power of two"):
        sample_tokens_triton(*_inputs(4, 100), chunk=1000)


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


def _stream_inputs(device="cpu"):
    """Streams over the whole [0, 2**63) range (both ends) and indices up to 2**62."""
    gen = torch.Generator().manual_seed(0)
    streams = torch.cat([torch.randint(0, 2**63 - 1, (2000,), generator=gen), torch.tensor([0, 1, 2**63 - 1])])
    index = torch.cat([torch.randint(0, 2**20, (2000,), generator=gen), torch.tensor([2**62, 0, 7])])
    return streams.to(device), index.to(device)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_stream_uniforms_equal_the_hosts_python_integers(impl):
    """Both implementations (int64 tensor arithmetic; uint64 in the Triton interpreter) give `stream_uniform`'s
    numbers bit for bit, across more than one kernel block."""
    from verl_moe.ops.sampling import uniforms

    streams, index = _stream_inputs()
    expect = [uniforms.stream_uniform(s, i) for s, i in zip(streams.tolist(), index.tolist())]
    fn = {"torch": uniforms.stream_uniforms_ref, "triton": uniforms.stream_uniforms_triton}[impl]
    assert fn(streams, index).tolist() == expect
    with pytest.raises(ValueError, match="int64 tensors of one shape"):
        fn(streams, index[:-1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stream_uniforms_on_cuda_equal_the_hosts():
    from verl_moe.ops.sampling import uniforms

    streams, index = _stream_inputs()
    expect = [uniforms.stream_uniform(s, i) for s, i in zip(streams.tolist(), index.tolist())]
    for fn in (uniforms.stream_uniforms_ref, uniforms.stream_uniforms_triton):
        assert fn(streams.cuda(), index.cuda()).cpu().tolist() == expect
