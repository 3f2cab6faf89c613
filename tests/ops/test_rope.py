"""RoPE: cos/sin equal transformers' rotary modules (plain and interleaved mRoPE, partial rotary);
the rotation vs fp64 and its defining properties; the Triton rotation (interpreter on CPU) vs the
fp64 reference, forward and backward.

Tolerances:
| quantity                            | fp32           | bf16         |
| cos/sin vs transformers             | bit-identical  |              |
| rotated q/k vs transformers         | bit-identical  |              |
| rotated q/k vs fp64                 | rel RMS 1e-6   |              |
| triton q, k, dq, dk vs fp64         | rel RMS 1e-6   | rel RMS 1e-2 |
| triton features past rotary_dim     | bit-identical  | bit-identical|
| relative-position invariance fp64   | 1e-10 absolute |              |
"""

import pytest
import torch
from transformers import Qwen3_5MoeTextConfig, Qwen3MoeConfig
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf35
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding
from verl_moe.ops import device
from verl_moe.ops.compare import assert_rel_rms, rel_rms
from verl_moe.ops.rope import apply_rotary_pos_emb, apply_rotary_pos_emb_ref, rope_cos_sin, rope_inv_freq

HEAD_DIM = 32
TRITON_TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}
DEV = device.current_device()


def qwen35_rotary(partial=0.5, section=(3, 3, 2)):
    cfg = Qwen3_5MoeTextConfig(
        head_dim=HEAD_DIM,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": partial,
            "mrope_section": list(section),
            "mrope_interleaved": True,
        },
    )
    return hf35.Qwen3_5MoeTextRotaryEmbedding(cfg), cfg


def mrope_positions(B=2, T=11):
    t = torch.arange(T)
    return torch.stack([t, t // 3 + 5, (t * 7) % 4])[:, None].expand(3, B, T).contiguous()


@pytest.mark.parametrize("section", [(3, 3, 2), (11, 11, 10)], ids=["exact-sections", "default-sections"])
def test_mrope_cos_sin_equal_transformers(section):
    hf, _ = qwen35_rotary(section=section)
    pos = mrope_positions()
    x = torch.zeros(1, dtype=torch.float32)
    cos_hf, sin_hf = hf(x, pos)
    inv = rope_inv_freq(HEAD_DIM, 10000.0, 0.5)
    assert torch.equal(inv, hf.inv_freq)
    cos, sin = rope_cos_sin(pos, inv, section, dtype=torch.float32)
    assert torch.equal(cos, cos_hf) and torch.equal(sin, sin_hf)
    # text positions [B, T] == three identical rows
    cos2, _ = rope_cos_sin(pos[0], inv, section)
    assert torch.equal(cos2, hf(x, pos[0])[0])


def test_plain_cos_sin_equal_transformers():
    cfg = Qwen3MoeConfig(
        head_dim=HEAD_DIM,
        hidden_size=64,
        num_attention_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    hf = Qwen3MoeRotaryEmbedding(cfg)
    pos = torch.arange(13).expand(2, 13)
    cos, sin = rope_cos_sin(pos, rope_inv_freq(HEAD_DIM, 1e6), None)
    cos_hf, sin_hf = hf(torch.zeros(1), pos)
    assert torch.equal(cos, cos_hf) and torch.equal(sin, sin_hf)


def test_partial_rotation_equals_transformers_and_fp64():
    hf, _ = qwen35_rotary()
    pos = mrope_positions()
    q, k = torch.randn(2, 11, 4, HEAD_DIM), torch.randn(2, 11, 2, HEAD_DIM)
    cos, sin = rope_cos_sin(pos, rope_inv_freq(HEAD_DIM, 10000.0, 0.5), (3, 3, 2))
    q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin)
    q_hf, k_hf = hf35.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    assert torch.equal(q_out, q_hf.transpose(1, 2)) and torch.equal(k_out, k_hf.transpose(1, 2))
    # only the first rotary_dim = 16 features rotate
    assert torch.equal(q_out[..., 16:], q[..., 16:])
    cos64, sin64 = rope_cos_sin(pos, rope_inv_freq(HEAD_DIM, 10000.0, 0.5, dtype=torch.float64), (3, 3, 2))
    q64, k64 = apply_rotary_pos_emb(q.double(), k.double(), cos64, sin64)
    assert_rel_rms("q", q64, q_out, 1e-6)
    assert_rel_rms("k", k64, k_out, 1e-6)


def test_rotation_is_relative_and_norm_preserving_fp64():
    """<R(p) q, R(p') k> depends only on p - p', and each rotated pair keeps its norm."""
    inv = rope_inv_freq(HEAD_DIM, 10000.0, dtype=torch.float64)
    q, k = torch.randn(1, 1, 1, HEAD_DIM, dtype=torch.float64), torch.randn(1, 1, 1, HEAD_DIM, dtype=torch.float64)

    def score(pq, pk):
        cq, sq = rope_cos_sin(torch.tensor([[pq]]), inv)
        ck, sk = rope_cos_sin(torch.tensor([[pk]]), inv)
        return (apply_rotary_pos_emb(q, q, cq, sq)[0] * apply_rotary_pos_emb(k, k, ck, sk)[0]).sum().item()

    assert abs(score(7, 3) - score(104, 100)) < 1e-10
    assert abs(score(0, 0) - (q * k).sum().item()) < 1e-10
    cos, sin = rope_cos_sin(torch.tensor([[37]]), inv)
    r = apply_rotary_pos_emb(q, k, cos, sin)[0]
    half = HEAD_DIM // 2
    assert torch.allclose(r[..., :half] ** 2 + r[..., half:] ** 2, q[..., :half] ** 2 + q[..., half:] ** 2)


def test_bad_inputs_raise():
    inv = rope_inv_freq(HEAD_DIM, 10000.0)
    with pytest.raises(ValueError, match="integer"):
        rope_cos_sin(torch.zeros(2, 3), inv)
    with pytest.raises(ValueError, match=r"\[B, T\] or \[3, B, T\]"):
        rope_cos_sin(torch.zeros(4, 2, 3, dtype=torch.long), inv, (1, 1, 1))
    with pytest.raises(ValueError, match="even"):
        rope_inv_freq(30, 10000.0, 0.1)
    cos, sin = rope_cos_sin(torch.zeros(2, 3, dtype=torch.long), inv)
    with pytest.raises(ValueError, match="cos/sin"):
        apply_rotary_pos_emb(torch.randn(2, 4, 1, HEAD_DIM), torch.randn(2, 4, 1, HEAD_DIM), cos, sin)


def triton_case(B, T, H, HKV, K, R, dtype, strided=True):
    """q as the first K features of a [B, T, H, 2K] projection (strided, as the model's split), k
    from a [B, HKV, T, K] tensor (head-major strides); cos/sin from real positions in `dtype`."""
    q = torch.randn(B, T, H, 2 * K, device=DEV).to(dtype)[..., :K]
    k = torch.randn(B, HKV, T, K, device=DEV).to(dtype).transpose(1, 2)
    if not strided:
        q, k = q.contiguous(), k.contiguous()
    pos = (torch.arange(T, device=DEV) * 7 + 3).expand(B, T)
    cos, sin = rope_cos_sin(pos, rope_inv_freq(K, 1e6, R / K, device=DEV), dtype=dtype)
    return q, k, cos, sin


def check_triton_vs_fp64(q, k, cos, sin, dtype):
    R = cos.shape[-1]
    a = [t.clone().requires_grad_() for t in (q, k)]
    out = apply_rotary_pos_emb(*a, cos, sin, impl="triton")
    a64 = [t.detach().double().requires_grad_() for t in (q, k)]
    ref = apply_rotary_pos_emb_ref(*a64, cos.double(), sin.double())
    dy = [torch.randn_like(r) for r in ref]
    sum((o * d.to(dtype)).sum() for o, d in zip(out, dy)).backward()
    sum((r * d).sum() for r, d in zip(ref, dy)).backward()
    assert out[0].dtype == out[1].dtype == dtype
    golden, got = (*ref, a64[0].grad, a64[1].grad), (*out, a[0].grad, a[1].grad)
    for name, r, o in zip(("q", "k", "dq", "dk"), golden, got):
        assert_rel_rms(name, r, o, TRITON_TOL[dtype])
    for x, o in zip((q, k), out):
        assert torch.equal(o[..., R:], x[..., R:])  # features past rotary_dim: a bitwise copy
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("K,R", [(24, 8), (16, 16)], ids=["K24-partial8", "K16-full"])
def test_triton_matches_fp64(nan_poison, dtype, K, R):
    """Odd head width with partial rotary, and full rotary; strided q/k read in place."""
    check_triton_vs_fp64(*triton_case(2, 5, 3, 1, K, R, dtype), dtype)


def test_triton_head_groups(nan_poison):
    """More q heads than one head group (8) and head counts that are not powers of two: 11 q heads in
    two groups (the second masked past 11), 3 kv heads in one; head-major k strides."""
    check_triton_vs_fp64(*triton_case(1, 3, 11, 3, 24, 8, torch.float32), torch.float32)


def test_triton_strided_equals_contiguous_and_is_deterministic():
    q, k, cos, sin = triton_case(1, 6, 2, 2, 24, 8, torch.float32)
    q_before, k_before = q.clone(), k.clone()
    first = apply_rotary_pos_emb(q, k, cos, sin, impl="triton")
    again = apply_rotary_pos_emb(q, k, cos, sin, impl="triton")
    dense = apply_rotary_pos_emb(q.contiguous(), k.contiguous(), cos, sin, impl="triton")
    # a last dim that is not contiguous (every other feature of a wider tensor) is copied first
    wide = torch.stack([q, torch.full_like(q, float("nan"))], -1).flatten(-2)[..., ::2]
    assert wide.stride(-1) == 2
    copied = apply_rotary_pos_emb(wide, k, cos, sin, impl="triton")
    for a, b, c, d in zip(first, again, dense, copied):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)  # out of place


def test_triton_bad_inputs_raise():
    q, k, cos, sin = triton_case(1, 3, 1, 1, 24, 8, torch.float32)
    with pytest.raises(ValueError, match="cos/sin"):
        apply_rotary_pos_emb(q, k, cos[:, :2], sin[:, :2], impl="triton")
    with pytest.raises(ValueError, match="no gradient"):
        apply_rotary_pos_emb(q, k, cos.requires_grad_(), sin, impl="triton")
    big = torch.zeros(1, 3, 1, 512)
    with pytest.raises(ValueError, match="up to 256"):
        apply_rotary_pos_emb(big, big, cos.detach(), sin, impl="triton")
    empty = apply_rotary_pos_emb(q[:, :0], k[:, :0], cos.detach()[:, :0], sin[:, :0], impl="triton")
    assert empty[0].shape == (1, 0, 1, 24) and empty[1].shape == (1, 0, 1, 24)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "H,HKV,K,R", [(16, 2, 256, 64), (32, 4, 128, 128)], ids=["qwen3.5-partial64", "qwen3moe-full128"]
)
def test_gpu_triton_qwen_shapes(H, HKV, K, R):
    q, k, cos, sin = triton_case(2, 2048, H, HKV, K, R, torch.bfloat16)
    out = check_triton_vs_fp64(q, k, cos, sin, torch.bfloat16)
    # one rounding in fp32 is at least as close to fp64 as the reference's bf16 products and sum
    ref64 = apply_rotary_pos_emb_ref(q.double(), k.double(), cos.double(), sin.double())
    ref16 = apply_rotary_pos_emb_ref(q, k, cos, sin)
    for r64, r16, o in zip(ref64, ref16, out):
        assert rel_rms(r64, o) <= rel_rms(r64, r16)
    again = apply_rotary_pos_emb(q, k, cos, sin, impl="triton")
    assert all(torch.equal(a, b.detach()) for a, b in zip(again, out))
