"""Qwen3.5-MoE in the megatron backend: the HF <-> megatron conversion of the hybrid stack
(`backends/megatron_names.py`), and megatron-core's mRoPE against transformers' Qwen3.5 rotary.

The forward/backward against the fp64 reference is `test_align_megatron.py`'s CPU case
`qwen3.5-gdn` (the same tolerances as Qwen3-MoE).

mRoPE: megatron-core's `MultimodalRotaryEmbedding` assigns the rotary frequencies to the (t, h, w)
position rows in contiguous sections; transformers' Qwen3.5 interleaves them (t h w t h w ...).
On text (three equal rows) both give plain RoPE, equal to fp32 rounding; on an image grid
(h, w varying) they differ on every frequency whose row differs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from verl_moe.tools.align import data
from verl_moe.tools.align.backends import megatron_names as names

ANGLE_MAX_ABS = 1e-5  # fp32 angles of positions < 64


def _arch(preset: str = "tiny-qwen3.5-moe"):
    from verl_moe import models

    config = data.hf_config(data.get_preset(preset))
    spec = models.get_spec(config.model_type)
    return spec.arch_config(spec.text_config(config)), config


def test_fuse_gated_qkv_matches_hand_built_megatron_layout():
    H, HKV, K, D = 4, 2, 3, 5  # 2 query heads per KV group
    q_gate = torch.randn(H * 2 * K, D, dtype=torch.float64)  # HF: per head K query rows, then K gate rows
    k, v = (torch.randn(HKV * K, D, dtype=torch.float64) for _ in range(2))
    query = [q_gate[h * 2 * K : h * 2 * K + K] for h in range(H)]
    gate = [q_gate[h * 2 * K + K : (h + 1) * 2 * K] for h in range(H)]
    expected = []  # megatron: per KV group its query heads, their gate heads, the key head, the value head
    for g in range(HKV):
        heads = range(g * H // HKV, (g + 1) * H // HKV)
        expected += (
            [query[h] for h in heads] + [gate[h] for h in heads] + [k[g * K : (g + 1) * K], v[g * K : (g + 1) * K]]
        )
    fused = names.fuse_gated_qkv(q_gate, k, v, H, HKV)
    assert torch.equal(fused, torch.cat(expected))
    assert not torch.equal(fused, names.fuse_qkv(q_gate, k, v, HKV))  # the example tells the layouts apart
    for got, want in zip(names.split_gated_qkv(fused, H, HKV, K), (q_gate, k, v)):
        assert torch.equal(got, want)


def test_qwen35_hf_megatron_round_trip_is_exact():
    from verl_moe import models

    arch, config = _arch()
    hf = models.build(config, dtype=torch.float32).state_dict()
    mc = names.hf_to_megatron(hf, arch)
    back = names.megatron_to_hf(mc, arch)
    assert sorted(back) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    gdn = [i for i, t in enumerate(arch.layer_types) if t == "linear_attention"]
    assert gdn and len(gdn) < len(arch.layer_types)  # the preset is hybrid
    for i in range(len(arch.layer_types)):
        prefix = f"decoder.layers.{i}.self_attention."
        assert (prefix + "in_proj.weight" in mc) == (i in gdn)
        assert (prefix + "linear_qkv.weight" in mc) == (i not in gdn)
    in_proj = mc[f"decoder.layers.{gdn[0]}.self_attention.in_proj.weight"]
    qk, v = (
        2 * arch.linear_num_key_heads * arch.linear_key_head_dim,
        arch.linear_num_value_heads * arch.linear_value_head_dim,
    )
    assert in_proj.shape[0] == qk + 2 * v + 2 * arch.linear_num_value_heads  # q | k | v | z | b | a


def test_check_supported_refuses_qwen35_parts_on_a_non_hybrid_stack():
    arch, _ = _arch()
    with pytest.raises(ValueError, match="without GatedDeltaNet"):
        names.hf_to_megatron({}, replace(arch, layer_types=("full_attention",) * len(arch.layer_types)))


# ---- mRoPE ------------------------------------------------------------------------------------


SECTION = (11, 11, 10)  # Qwen3.5's mrope_section (frequencies per t, h, w row)
HEAD_DIM, PARTIAL, THETA = 256, 0.25, 10_000_000.0  # the released models' attention heads


def _angles(monkeypatch, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary angles [B, S, rot_dim/2] (wrapped to (-pi, pi]) of transformers' Qwen3.5 rotary
    (from its cos/sin) and of megatron-core's `MultimodalRotaryEmbedding`, for positions [3, B, S]."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'verl-moe[megatron]')")
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # where megatron puts inv_freq
    config = Qwen3_5MoeTextConfig(
        head_dim=HEAD_DIM,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": THETA,
            "partial_rotary_factor": PARTIAL,
            "mrope_section": list(SECTION),
            "mrope_interleaved": True,
        },
    )
    cos, sin = Qwen3_5MoeTextRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), position_ids)
    half = cos.shape[-1] // 2
    hf = torch.atan2(sin[..., :half].double(), cos[..., :half].double())
    emb = MultimodalRotaryEmbedding(kv_channels=HEAD_DIM, rotary_percent=PARTIAL, rotary_base=THETA)(
        position_ids, list(SECTION)
    )  # [S, B, 1, rot_dim]: the half-dim angles twice
    mc = emb.squeeze(2).transpose(0, 1)[..., :half].double()
    return hf, torch.atan2(mc.sin(), mc.cos())


def _expected(position_ids: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """fp64 angles (wrapped) when frequency j takes position row rows[j]."""
    dim = int(HEAD_DIM * PARTIAL)
    inv_freq = 1.0 / THETA ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    pos = position_ids.double()[torch.tensor(rows)]  # [rot_dim/2, B, S]
    angles = pos.permute(1, 2, 0) * inv_freq
    return torch.atan2(angles.sin(), angles.cos())


HF_ROWS = [1 if j % 3 == 1 and j < 3 * SECTION[1] else 2 if j % 3 == 2 and j < 3 * SECTION[2] else 0 for j in range(32)]
MEGATRON_ROWS = [0] * SECTION[0] + [1] * SECTION[1] + [2] * SECTION[2]


def test_megatron_mrope_equals_hf_on_text_positions(monkeypatch):
    text = torch.arange(64).expand(3, 2, 64)  # t = h = w: plain RoPE
    hf, mc = _angles(monkeypatch, text)
    assert hf.shape == mc.shape == (2, 64, 32)
    assert (hf - mc).abs().max().item() < ANGLE_MAX_ABS


def test_megatron_mrope_takes_contiguous_sections_hf_interleaves(monkeypatch):
    h, w = torch.meshgrid(torch.arange(8), torch.arange(8), indexing="ij")
    grid = torch.stack([torch.full((64,), 3), h.flatten() + 3, w.flatten() + 3])[:, None]  # an 8x8 image at t=3
    hf, mc = _angles(monkeypatch, grid)
    assert (hf - _expected(grid, HF_ROWS)).abs().max().item() < ANGLE_MAX_ABS
    assert (mc - _expected(grid, MEGATRON_ROWS)).abs().max().item() < ANGLE_MAX_ABS
    assert sum(a != b for a, b in zip(HF_ROWS, MEGATRON_ROWS)) > 0  # the grid tells the layouts apart
    assert (hf - mc).abs().max().item() > 100 * ANGLE_MAX_ABS
