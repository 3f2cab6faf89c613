"""Causal GQA attention over packed sequences vs an explicit fp64 masked-softmax formula.

Tolerances (rel RMS vs the fp64 formula):
| dtype | out  | dq, dk, dv |
| fp32  | 1e-6 | 1e-5       |
| bf16  | 1e-2 | -          |
"""

import pytest
import torch
from verl_moe.ops.attention import causal_attention
from verl_moe.ops.testing import assert_rel_rms

LENGTHS = [6, 1, 11, 4]
H, HKV, K = 4, 2, 8


def formula(q, k, v, lengths):
    """softmax(q k^T / sqrt(K) + mask) v with a block-diagonal causal mask, fp64, explicit GQA mapping."""
    q, k, v = q.double()[0], k.double()[0], v.double()[0]
    T = q.shape[0]
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    allowed = (seq[:, None] == seq[None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    out = torch.empty(T, H, v.shape[-1], dtype=torch.float64)
    for h in range(H):
        kv = h // (H // HKV)
        s = q[:, h] @ k[:, kv].T / K**0.5
        out[:, h] = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v[:, kv]
    return out[None]


def inputs(dtype=torch.float32):
    T = sum(LENGTHS)
    q, k, v = torch.randn(1, T, H, K), torch.randn(1, T, HKV, K), torch.randn(1, T, HKV, K)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    return q.to(dtype), k.to(dtype), v.to(dtype), cu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_matches_formula(dtype):
    q, k, v, cu = inputs(dtype)
    out = causal_attention(q, k, v, cu_seqlens=cu)
    assert out.dtype == dtype and out.shape == q.shape
    assert_rel_rms("attention", formula(q, k, v, LENGTHS), out, 1e-6 if dtype == torch.float32 else 1e-2)


def test_packed_equals_per_sequence_and_batch_rows():
    q, k, v, cu = inputs()
    packed = causal_attention(q, k, v, cu_seqlens=cu)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = causal_attention(q[:, s:e], k[:, s:e], v[:, s:e])
        assert_rel_rms(f"seq {s}:{e}", alone, packed[:, s:e], 1e-6)
    # a [B, T] batch is B independent causal sequences
    qb, kb, vb = (t[:, :12].reshape(2, 6, *t.shape[2:]) for t in (q, k, v))
    batch = causal_attention(qb, kb, vb)
    assert_rel_rms("row 1", causal_attention(qb[1:], kb[1:], vb[1:]), batch[1:], 1e-6)


def test_gradients_match_fp64():
    q, k, v, cu = inputs()
    dy = torch.randn_like(q)
    a64 = [t.double().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad((formula(*a64, LENGTHS) * dy.double()).sum(), a64)
    a32 = [t.clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad((causal_attention(*a32, cu_seqlens=cu) * dy).sum(), a32)
    for name, r, g in zip(("dq", "dk", "dv"), ref, got):
        assert_rel_rms(name, r, g, 1e-5)


def test_bad_inputs_raise():
    q, k, v, cu = inputs()
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        causal_attention(q[:, :, :3], k, v)
    with pytest.raises(ValueError, match="share one floating dtype"):
        causal_attention(q, k.double(), v)
    with pytest.raises(ValueError, match="non-decreasing"):
        causal_attention(q, k, v, cu_seqlens=torch.tensor([0, 8, 3, 22]))
    with pytest.raises(ValueError, match="B == 1"):
        causal_attention(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), cu_seqlens=cu)
