"""Causal GQA attention over packed sequences vs an explicit fp64 masked-softmax formula: the per-sequence
reference, FlexAttention with a document mask (eager, forward only on CPU) and, on cuda, flash
attention's varlen path (the default there) and compiled FlexAttention at Qwen3.5 shapes.

Tolerances (rel RMS vs the fp64 formula):
| dtype | out   | dq, dk, dv |
| fp64  | 1e-12 | -          |
| fp32  | 1e-6  | 1e-5       |
| bf16  | 1e-2  | 1e-2       |
"""

import pytest
import torch
from verl_moe.ops import device
from verl_moe.ops.attention import ACCELERATOR_DEFAULT, causal_attention
from verl_moe.ops.compare import assert_rel_rms
from verl_moe.ops.dispatch import resolve

LENGTHS = [6, 1, 11, 4]
WITH_EMPTY = [6, 1, 0, 11, 4, 1]
H, HKV, K = 4, 2, 8
OUT_TOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}
DEV = device.current_device()
QWEN = {"H": 16, "HKV": 2, "K": 256}


def formula(q, k, v, lengths, scale=None):
    """softmax(scale q k^T + mask) v with a block-diagonal causal mask, fp64, explicit GQA mapping."""
    q, k, v = q.double()[0], k.double()[0], v.double()[0]
    T, heads, kv_heads = q.shape[0], q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(q.device)
    allowed = (seq[:, None] == seq[None, :]) & torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    out = torch.empty(T, heads, v.shape[-1], dtype=torch.float64, device=q.device)
    for h in range(heads):
        kv = h // (heads // kv_heads)
        s = q[:, h] @ k[:, kv].T * scale
        out[:, h] = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v[:, kv]
    return out[None]


def packed(lengths, dtype, H=H, HKV=HKV, K=K, dev=DEV):
    """q [1, T, H, K], k, v [1, T, HKV, K] in dtype, and cu_seqlens of `lengths` (int32)."""
    T = sum(lengths)
    q, k, v = (torch.randn(1, T, n, K, device=dev).to(dtype) for n in (H, HKV, HKV))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    return q, k, v, cu


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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
def test_flex_packed_matches_formula(dtype):
    """One FlexAttention call over all sequences (lengths 1 and 0 included), GQA, a non-default scale."""
    q, k, v, cu = packed(WITH_EMPTY, dtype, dev="cpu")
    with torch.no_grad():
        out = causal_attention(q, k, v, scale=0.3, cu_seqlens=cu, impl="flex")
    assert out.dtype == dtype and out.shape == q.shape
    assert_rel_rms("flex", formula(q, k, v, WITH_EMPTY, scale=0.3), out, OUT_TOL[dtype])


def test_flex_batch_rows_and_cpu_backward_refused():
    q, k, v, _ = packed([12], torch.float32, dev="cpu")
    qb, kb, vb = (t.reshape(2, 6, *t.shape[2:]) for t in (q, k, v))
    with torch.no_grad():
        batch = causal_attention(qb, kb, vb, impl="flex")
    for b in range(2):
        assert_rel_rms(f"row {b}", formula(qb[b : b + 1], kb[b : b + 1], vb[b : b + 1], [6]), batch[b : b + 1], 1e-6)
    with pytest.raises(ValueError, match="no CPU backward"):
        causal_attention(q.requires_grad_(), k, v, impl="flex")


def test_varlen_refused_off_accelerator_and_not_the_cpu_default():
    q, k, v, cu = packed(LENGTHS, torch.bfloat16, dev="cpu")
    with pytest.raises(ValueError, match="runs on cuda"):
        causal_attention(q, k, v, cu_seqlens=cu, impl="varlen")
    if not device.is_accelerator():
        assert resolve("attention") is resolve("attention", "torch")


def test_long_sequence_path_matches_formula_with_shared_kv_heads():
    """The varlen op's path for long sequences (`per_sequence_sdpa`: SDPA per sequence, key/value heads
    not repeated) on CPU's SDPA in fp64: packed rows with an empty sequence, and a batch of rows."""
    from verl_moe.ops.attention.varlen import per_sequence_sdpa

    q, k, v, cu = packed(WITH_EMPTY, torch.float64, dev="cpu")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = per_sequence_sdpa(*leaves, 0.3, cu, True)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = formula(*ref_leaves, WITH_EMPTY, scale=0.3)
    assert_rel_rms("o", ref, out, 1e-12)
    dy = torch.randn_like(ref)
    (out * dy).sum().backward()
    (ref * dy).sum().backward()
    for name, a, b in zip(("dq", "dk", "dv"), ref_leaves, leaves):
        assert_rel_rms(name, a.grad, b.grad, 1e-12)
    rows = [t.reshape(2, 6, *t.shape[2:]) for t in packed([12], torch.float64, dev="cpu")[:3]]
    out = per_sequence_sdpa(*rows, 0.3, None, True)
    for b in range(2):
        assert_rel_rms(f"row {b}", formula(*(t[b : b + 1] for t in rows), [6], scale=0.3), out[b : b + 1], 1e-12)


def run_with_grads(impl, q, k, v, cu, dy, strided=False):
    """o and (dq, dk, dv) of sum(o * dy); strided: q is read as the first half of a [1, T, H, 2K]
    leaf (the model's q/gate split)."""
    if strided:
        wide = torch.cat([q, torch.zeros_like(q)], -1).requires_grad_()
        leaves, q_in = [wide, k.clone().requires_grad_(), v.clone().requires_grad_()], wide[..., : q.shape[-1]]
    else:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        q_in = leaves[0]
    out = causal_attention(q_in, *leaves[1:], scale=0.06, cu_seqlens=cu, impl=impl)
    (out * dy.to(out.dtype)).sum().backward()
    grads = [leaves[0].grad[..., : q.shape[-1]], leaves[1].grad, leaves[2].grad]
    return out.detach(), grads


def check_gpu(impl, lengths, strided=False):
    """impl vs the fp64 formula at Qwen3.5 shapes, bf16: o and every gradient."""
    q, k, v, cu = packed(lengths, torch.bfloat16, **QWEN)
    dy = torch.randn(q.shape, dtype=torch.float64, device=DEV)
    out, grads = run_with_grads(impl, q, k, v, cu, dy, strided)
    a64 = [t.double().requires_grad_() for t in (q, k, v)]
    ref = formula(*a64, lengths, scale=0.06)
    (ref * dy).sum().backward()
    assert_rel_rms(f"{impl} o", ref, out, 1e-2)
    for name, r, g in zip(("dq", "dk", "dv"), a64, grads):
        assert_rel_rms(f"{impl} {name}", r.grad, g, 1e-2)


@pytest.mark.gpu
def test_gpu_varlen_is_the_cuda_default_and_matches_formula():
    if device.device_type() == "cuda":
        assert ACCELERATOR_DEFAULT == "varlen" and resolve("attention") is resolve("attention", "varlen")
    check_gpu("varlen", [1, 0, 300, 7, 1000, 64, 1], strided=True)


@pytest.mark.gpu
def test_gpu_varlen_batch_rows_deterministic_and_refuses_fp32():
    q, k, v, _ = packed([2 * 513], torch.bfloat16, **QWEN)
    qb, kb, vb = (t.reshape(2, 513, *t.shape[2:]) for t in (q, k, v))
    batch = causal_attention(qb, kb, vb, impl="varlen")
    assert_rel_rms("row 1", formula(qb[1:], kb[1:], vb[1:], [513]), batch[1:], 1e-2)
    # bitwise repeatable: the forward always, the backward under deterministic algorithms
    q, k, v, cu = packed([700, 1, 300], torch.bfloat16, **QWEN)
    dy = torch.randn_like(q)
    torch.use_deterministic_algorithms(True)
    try:
        (o1, g1), (o2, g2) = (run_with_grads("varlen", q, k, v, cu, dy) for _ in range(2))
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(o1, o2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
    with pytest.raises(ValueError, match="float16/bfloat16"):
        causal_attention(q.float(), k.float(), v.float(), cu_seqlens=cu, impl="varlen")


@pytest.mark.gpu
@pytest.mark.gpu_memory
def test_gpu_varlen_long_sequences_match_formula():
    """Mean length >= LONG_SEQUENCE: the per-sequence SDPA path with shared key/value heads."""
    check_gpu("varlen", [5000, 0, 4200], strided=True)


@pytest.mark.gpu
def test_gpu_flex_compiled_matches_formula():
    check_gpu("flex", [1, 0, 300, 7, 700, 1])
