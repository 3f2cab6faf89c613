"""One-token decode attention (`ops/attention/decode.py`): the reference and the Triton kernel
(interpreter on CPU) against an fp64 softmax written out per row and head, over fixed-capacity caches
where each row sees its own count of positions.

Bounds (relative RMS error vs fp64 on the same inputs): fp32 1e-5; bf16 2e-2 (bf16 inputs, and the
kernel's p v product takes p in bf16 as flash attention does).
"""

from __future__ import annotations

import os

import pytest
import torch
from verl_moe.ops import device

if not device.is_accelerator():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from verl_moe.ops.attention.decode import decode_attention_ref  # noqa: E402
from verl_moe.ops.compare import assert_rel_rms  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _inputs(B, H, HKV, L, D, dtype, counts, slots=None, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, D, generator=gen)
    k = torch.randn(slots or B, HKV, L, D, generator=gen)
    v = torch.randn(slots or B, HKV, L, D, generator=gen)
    return [t.to(device, dtype) for t in (q, k, v)] + [torch.tensor(counts, device=device)]


def _fp64(q, k, v, counts, scale):
    """softmax(q k^T scale) v row by row and head by head, each over its first counts[b] positions."""
    B, H, D = q.shape
    group = H // k.shape[1]
    out = torch.empty(B, H, D, dtype=torch.float64)
    for b in range(B):
        n = int(counts[b])
        for h in range(H):
            keys, values = k[b, h // group, :n].double(), v[b, h // group, :n].double()
            out[b, h] = torch.softmax(keys @ q[b, h].double() * scale, 0) @ values
    return out


def _impls():
    from verl_moe.ops.attention.decode_kernel import decode_attention_triton

    return {"torch": decode_attention_ref, "triton": decode_attention_triton}


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_fp64_per_row_counts(impl, dtype):
    """Counts of 1, one tile exactly, one past a tile, the whole capacity; 3 query heads per kv head;
    a head dim (40) below its chunk; more cache slots than rows."""
    counts = [1, 128, 129, 300, 77]
    q, k, v, n = _inputs(5, 6, 2, 300, 40, dtype, counts, slots=7)
    out = _impls()[impl](q, k, v, n, 40**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    assert_rel_rms("out", _fp64(q, k, v, n, 40**-0.5), out, TOL[dtype])


def test_kernel_head_dim_over_one_chunk_and_positions_past_the_count_unread():
    """A head dim of 160 (two 128-wide chunks, the second partial); NaN in every cache position past each
    row's count must not reach the output."""
    from verl_moe.ops.attention.decode_kernel import decode_attention_triton

    counts = [3, 200]
    q, k, v, n = _inputs(2, 4, 1, 256, 160, torch.float32, counts)
    for b, c in enumerate(counts):
        k[b, :, c:] = float("nan")
        v[b, :, c:] = float("nan")
    out = decode_attention_triton(q, k, v, n, 0.1)
    assert_rel_rms("out", _fp64(q, k, v, n, 0.1), out, TOL[torch.float32])


def test_kernel_reads_counts_and_slots_given_as_strided_views():
    """Counts and slots passed as columns of wider tensors (speculative decoding's verification passes a
    slot per row as an expanded view): each row reads its own count and slot, not its neighbours' in memory."""
    from verl_moe.ops.attention.decode_kernel import decode_attention_triton

    q, k, v, _ = _inputs(4, 4, 2, 64, 16, torch.float32, [1] * 4, slots=3)
    counts = torch.tensor([[5, 60], [64, 1], [17, 2], [1, 33]])[:, 0]
    slots = torch.tensor([[2, 0], [0, 1], [1, 2], [2, 0]])[:, 0]
    out = decode_attention_triton(q, k, v, counts, 0.25, slots=slots)
    assert_rel_rms("out", _fp64(q, k[slots], v[slots], counts, 0.25), out, TOL[torch.float32])


def test_bad_inputs_raise_one_line():
    q, k, v, n = _inputs(2, 4, 2, 16, 8, torch.float32, [1, 2])
    with pytest.raises(ValueError, match="counts must be"):
        decode_attention_ref(q, k, v, n.int(), 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        decode_attention_ref(q[:, :3], k, v, n, 1.0)
    with pytest.raises(ValueError, match="q must be"):
        decode_attention_ref(q, k, v[:, :, :8], n, 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_matches_fp64_at_the_reduced_models_shapes():
    """256 rows, 16 query heads over 2 kv heads of 256, capacity 512, counts spread over it, bf16."""
    gen = torch.Generator().manual_seed(1)
    counts = torch.randint(1, 513, (256,), generator=gen).tolist()
    q, k, v, n = _inputs(256, 16, 2, 512, 256, torch.bfloat16, counts, device="cuda")
    ref = _fp64(q.cpu(), k.cpu(), v.cpu(), n.cpu(), 256**-0.5)
    for impl in ("torch", "triton"):
        assert_rel_rms(impl, ref, _impls()[impl](q, k, v, n, 256**-0.5).cpu(), TOL[torch.bfloat16])
