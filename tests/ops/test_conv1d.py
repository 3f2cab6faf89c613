"""Depthwise causal conv1d + SiLU over packed sequences vs an explicit fp64 loop.

Tolerances (rel RMS vs the fp64 loop):
| dtype | out  | dx, dw, dbias |
| fp32  | 1e-6 | 1e-5          |
| bf16  | 1e-2 | -             |
"""

import pytest
import torch
import torch.nn.functional as F
from verl_moe.ops.conv1d import causal_conv1d
from verl_moe.ops.testing import assert_rel_rms

LENGTHS = [5, 1, 9, 3]  # includes a length-1 sequence and one shorter than the kernel
C, W = 12, 4


def loop_formula(x, weight, bias, lengths):
    """out[t, c] = silu(sum_j weight[c, j] * x[t - W + 1 + j, c] + bias[c]), zero before each sequence start."""
    x, weight = x.double()[0], weight.double()
    out = torch.zeros_like(x)
    start = 0
    for n in lengths:
        for t in range(start, start + n):
            acc = bias.double().clone() if bias is not None else torch.zeros(x.shape[1], dtype=torch.float64)
            for j in range(W):
                src = t - W + 1 + j
                if src >= start:
                    acc += weight[:, j] * x[src]
            out[t] = F.silu(acc)
        start += n
    return out[None]


def inputs(dtype=torch.float32, bias=True):
    T = sum(LENGTHS)
    x = torch.randn(1, T, C, dtype=dtype)
    w = torch.randn(C, W, dtype=dtype) * 0.5
    b = torch.randn(C, dtype=dtype) * 0.1 if bias else None
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return x, w, b, cu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_packed_matches_loop(dtype, bias, nan_poison):
    x, w, b, cu = inputs(dtype, bias)
    out = causal_conv1d(x, w, b, activation="silu", cu_seqlens=cu)
    assert out.dtype == dtype
    assert_rel_rms("conv1d", loop_formula(x, w, b, LENGTHS), out, 1e-6 if dtype == torch.float32 else 1e-2)


def test_batch_rows_equal_torch_conv_and_no_cross_sequence_leak():
    x, w, _, cu = inputs()
    # unpacked batch: each row one sequence, equal to transformers' torch path (padded nn.Conv1d, truncated)
    xb = torch.randn(3, 7, C)
    conv = torch.nn.Conv1d(C, C, W, groups=C, bias=False, padding=W - 1)
    with torch.no_grad():
        conv.weight.copy_(w.unsqueeze(1))
        hf = F.silu(conv(xb.transpose(1, 2))[..., :7]).transpose(1, 2)
    assert_rel_rms("batch", hf, causal_conv1d(xb, w, None), 1e-6)
    # perturbing sequence 2 changes nothing outside it
    out = causal_conv1d(x, w, None, cu_seqlens=cu)
    x2 = x.clone()
    x2[:, cu[2] : cu[3]] += 10.0
    out2 = causal_conv1d(x2, w, None, cu_seqlens=cu)
    outside = torch.ones(x.shape[1], dtype=torch.bool)
    outside[cu[2] : cu[3]] = False
    assert torch.equal(out[:, outside], out2[:, outside])
    assert not torch.equal(out[:, ~outside], out2[:, ~outside])


def test_gradients_match_fp64():
    x, w, b, cu = inputs()
    dy = torch.randn_like(x)
    args64 = [t.double().requires_grad_() for t in (x, w, b)]
    ref = torch.autograd.grad((loop_formula(*args64, LENGTHS) * dy.double()).sum(), args64)
    args32 = [t.clone().requires_grad_() for t in (x, w, b)]
    got = torch.autograd.grad((causal_conv1d(*args32, cu_seqlens=cu) * dy).sum(), args32)
    for name, r, g in zip(("dx", "dw", "dbias"), ref, got):
        assert_rel_rms(name, r, g, 1e-5)


def test_bad_inputs_raise():
    x, w, b, cu = inputs()
    with pytest.raises(ValueError, match="non-decreasing"):
        causal_conv1d(x, w, b, cu_seqlens=torch.tensor([0, 9, 4, 18], dtype=torch.int32))
    with pytest.raises(ValueError, match="ends at"):
        causal_conv1d(x, w, b, cu_seqlens=torch.tensor([0, 5, 17], dtype=torch.int32))
    with pytest.raises(ValueError, match="B == 1"):
        causal_conv1d(x.expand(2, -1, -1), w, b, cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"weight must be \[C, W\]"):
        causal_conv1d(x, w[:-1], b)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, w, b, activation="gelu")
