"""`models/flops.py` against counts taken from the built models: their parameter shapes, and the
FLOPs `torch.utils.flop_counter` sees in their forward (exact integers, so every check is equality).

What the flop counter sees on CPU in fp64 with the torch ops, SDPA forced to its math backend:
`aten.mm` / `aten.addmm` / `aten.convolution` are the weight products (projections, router, the experts each token
visits, conv taps, lm_head); `aten.bmm` are the token mixers' cores. It counts attention over the
full s x s score matrix (the causal mask is not free for it) and, for the GatedDeltaNet run by the
token-by-token reference, the two einsums on the state (read and output) but not the rank-1 update,
which that reference writes elementwise.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import verl_moe.models as vm
from test_vision import sample, tiny_vl_config
from tiny_models import packed_inputs, tiny_qwen3_5_moe_text, tiny_qwen3_moe
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from verl_moe.models import flops
from verl_moe.models.qwen3_5_moe.gated_deltanet import GatedDeltaNet
from verl_moe.ops.gdn import recurrent_gated_delta_rule_ref

LENGTHS = [7, 1, 12]  # packed sequences, one of length 1
CONFIGS = {
    "qwen3_5_moe": tiny_qwen3_5_moe_text,
    "qwen3_moe": tiny_qwen3_moe,  # a dense layer among MoE ones
    "qwen3_moe_tied": lambda: tiny_qwen3_moe(tie_word_embeddings=True),
}
MM, ADDMM, CONV, BMM = torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.convolution, torch.ops.aten.bmm


def _counted(run) -> dict[str, dict]:
    """Per-module FLOPs of `run()` by op, as `FlopCounterMode.get_flop_counts` reports them."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as mode:
        run()
    return mode.get_flop_counts()


def _own(counts: dict, module: str, op) -> int:
    """FLOPs of `op` that `module` ran itself (its total minus its direct children's)."""
    prefix = module + "."
    children = [m for m in counts if m.startswith(prefix) and "." not in m[len(prefix) :]]
    return counts[module].get(op, 0) - sum(counts[c].get(op, 0) for c in children)


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_moe"])
def test_active_params_are_the_models_matrices(name):
    """Every weight of two or more dims but the embedding, routed experts as TOPK of E of them."""
    model = vm.build(CONFIGS[name]())
    arch = model.arch
    share = arch.num_experts_per_tok / arch.num_experts
    total = sum(
        p.numel() * (share if ".experts." in n else 1)
        for n, p in model.named_parameters()
        if p.dim() >= 2 and "embed_tokens" not in n
    )
    assert flops.active_params(arch) == total


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_flops_match_the_flop_counter(name):
    torch.manual_seed(0)
    model = vm.build(CONFIGS[name](), dtype=torch.float64, ops=vm.OpsConfig(router_dtype="model"))
    arch = model.arch
    for module in model.modules():
        if isinstance(module, GatedDeltaNet):
            module.ops = dataclasses.replace(module.ops, gdn=recurrent_gated_delta_rule_ref)
    ids, pos, cu = packed_inputs(LENGTHS)
    T = sum(LENGTHS)
    counts = _counted(lambda: model.logits(model(ids, pos, cu).last_hidden_state))
    total = counts["Global"]

    # weights: 2 FLOPs per weight and token, the experts each token visits included
    assert total.get(MM, 0) + total.get(CONV, 0) == 2 * flops.active_params(arch) * T

    attention = [
        f"MoeCausalLM.model.layers.{i}.self_attn" for i, t in enumerate(arch.layer_types) if t != "linear_attention"
    ]
    full_square = sum(_own(counts, m, BMM) for m in attention)
    diagonal = len(attention) * 4 * arch.head_dim * arch.num_attention_heads * T
    # causal pairs s (s + 1) / 2 = (s^2 + s) / 2 of each sequence
    assert 2 * flops.attention_flops(arch, LENGTHS) == full_square + diagonal

    gdn = [
        f"MoeCausalLM.model.layers.{i}.linear_attn" for i, t in enumerate(arch.layer_types) if t == "linear_attention"
    ]
    read_and_output = sum(_own(counts, m, BMM) for m in gdn)
    # three state products per token and head, of which the reference runs two as einsums
    assert 2 * flops.linear_attention_flops(arch, T) == 3 * read_and_output
    assert total.get(BMM, 0) == full_square + read_and_output  # nothing else ran as a batched product

    assert flops.forward_flops(arch, LENGTHS) == (
        2 * flops.active_params(arch) * T + flops.attention_flops(arch, LENGTHS) + flops.linear_attention_flops(arch, T)
    )


def test_vision_flops_match_the_flop_counter():
    """The tower's weights per patch (the merger per merged token) and bidirectional attention per
    frame: what the flop counter sees in the tower, exactly (attention over the full square)."""
    torch.manual_seed(0)
    model = vm.build(tiny_vl_config(), dtype=torch.float64)
    vision = model.vision
    grids = [(1, 4, 4), (2, 4, 6)]  # an image, a two-frame video
    gen = torch.Generator().manual_seed(0)
    _, pix_i, pix_v = sample(gen, images=grids[:1], videos=grids[1:])
    pixels = torch.cat([pix_i[0], pix_v[0]]).double()
    frames = [h * w for t, h, w in grids for _ in range(t)]  # verl's images_seqlens
    counts = _counted(lambda: model.model.visual(pixels, torch.tensor(grids)))
    tower = counts["VisionModel"]
    assert set(tower) <= {MM, ADDMM, BMM}  # the ViT's projections carry biases: addmm
    assert sum(tower.values()) == flops.vision_flops(vision, frames)
    merger = counts["VisionModel.merger"]
    per_patch, per_merged = flops.vision_params(vision)
    assert sum(merger.values()) == 2 * per_merged * sum(frames) // vision.spatial_merge_size**2
