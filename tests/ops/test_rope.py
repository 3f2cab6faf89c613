"""RoPE: cos/sin equal transformers' rotary modules (plain and interleaved mRoPE, partial rotary);
the rotation vs fp64 and its defining properties.

Tolerances:
| quantity                          | fp32           |
| cos/sin vs transformers           | bit-identical  |
| rotated q/k vs transformers       | bit-identical  |
| rotated q/k vs fp64               | rel RMS 1e-6   |
| relative-position invariance fp64 | 1e-10 absolute |
"""

import pytest
import torch
from transformers import Qwen3_5MoeTextConfig, Qwen3MoeConfig
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf35
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding
from verl_moe.ops.rope import apply_rotary_pos_emb, rope_cos_sin, rope_inv_freq
from verl_moe.ops.testing import assert_rel_rms

HEAD_DIM = 32


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
