"""Attention of chunks that continue their decode slots (`ops/attention/cached.py`): the torch reference
and the Triton form (its short chunks as rows of the decode-attention kernel reading a slot each;
interpreter on CPU) against an fp64 softmax written out per row and head: row i of a chunk that starts at
position s of its slot sees that slot's positions [0, s + i].

Bounds (relative RMS error vs fp64): fp32 1e-5; bf16 2e-2, as the decode attention's.
"""

from __future__ import annotations

import os

import pytest
import torch
from verl_moe.ops import device

if not device.is_accelerator():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from verl_moe.ops.attention import cached  # noqa: E402
from verl_moe.ops.compare import assert_rel_rms  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
HKV, G, L, D = 2, 3, 160, 40


def _case(lengths, slots, dtype, dev="cpu"):
    gen = torch.Generator().manual_seed(0)
    T = sum(lengths)
    q = torch.randn(T, HKV * G, D, generator=gen)
    k = torch.randn(max(slots) + 2, HKV, L, D, generator=gen)
    v = torch.randn(max(slots) + 2, HKV, L, D, generator=gen)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return [t.to(dev, dtype) for t in (q, k, v)], cu


def _fp64(q, k, v, slots, starts, cu, scale):
    """softmax(q k^T scale) v row by row: row i of chunk n over its slot's positions [0, starts[n] + i]."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for n, (slot, start) in enumerate(zip(slots, starts)):
        for i, row in enumerate(range(cu[n], cu[n + 1])):
            seen = start + i + 1
            keys = k[slot, :, :seen].double().repeat_interleave(group, 0)  # [H, seen, D]
            values = v[slot, :, :seen].double().repeat_interleave(group, 0)
            p = torch.softmax(torch.einsum("hd,hsd->hs", q[row].double(), keys) * scale, -1)
            out[row] = torch.einsum("hs,hsd->hd", p, values)
    return out


IMPLS = {"torch": cached.cached_attention_ref, "triton": cached.cached_attention_triton}


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_short_chunks_match_fp64(impl, dtype):
    """Verification-shaped chunks (1-4 rows) in slots out of order, one starting past a 128-position tile,
    one at position 0 of its slot."""
    lengths, slots, starts = [3, 1, 4, 2], [4, 0, 2, 1], [10, 127, 130, 0]
    (q, k, v), cu = _case(lengths, slots, dtype)
    out = IMPLS[impl](q, k, v, slots, starts, cu, D**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    assert_rel_rms("out", _fp64(q, k, v, slots, starts, cu, D**-0.5), out, TOL[dtype])


def test_long_chunk_takes_the_reference(monkeypatch):
    """A chunk over SHORT_CHUNK rows (a prompt prefilled in pieces): the Triton form gives the reference's
    result, computed by it (the decode kernel is not called)."""
    import verl_moe.ops.attention.decode_kernel as decode_kernel

    lengths, slots, starts = [cached.SHORT_CHUNK + 1, 2], [1, 0], [5, 7]
    (q, k, v), cu = _case(lengths, slots, torch.float32)

    def refuse(*args, **kwargs):
        raise AssertionError("the decode kernel ran for a long chunk")

    monkeypatch.setattr(decode_kernel, "decode_attention_triton", refuse)
    out = cached.cached_attention_triton(q, k, v, slots, starts, cu, D**-0.5)
    assert torch.equal(out, cached.cached_attention_ref(q, k, v, slots, starts, cu, D**-0.5))
    assert_rel_rms("out", _fp64(q, k, v, slots, starts, cu, D**-0.5), out, TOL[torch.float32])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_matches_fp64_at_the_reduced_models_shapes():
    """64 slots x 3 verification rows, 16 query heads over 2 kv heads of 256, bf16."""
    gen = torch.Generator().manual_seed(1)
    starts = torch.randint(0, 400, (64,), generator=gen).tolist()
    slots = torch.randperm(64, generator=gen).tolist()
    cu = [3 * n for n in range(65)]
    q = torch.randn(192, 16, 256, generator=gen)
    k, v = torch.randn(2, 64, 2, 512, 256, generator=gen)
    q, k, v = (t.cuda().bfloat16() for t in (q, k, v))
    ref = _fp64(q.cpu(), k.cpu(), v.cpu(), slots, starts, cu, 256**-0.5)
    out = cached.cached_attention_triton(q, k, v, slots, starts, cu, 256**-0.5)
    assert_rel_rms("out", ref, out.cpu(), TOL[torch.bfloat16])
