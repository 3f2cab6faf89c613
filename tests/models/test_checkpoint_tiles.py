"""Checkpointing inside the decoder layers in token tiles (`fsdp_plan.checkpoint_in_tiles`), CPU, fp64.

The GatedDeltaNet in tiles carries the recurrence's state and the conv's context across tile borders, so
it must equal the untiled mixer (output and every gradient, fp64 round-off: the chunked recurrence
restarts its 64-token chunks at tile borders) for packed rows whose sequences cross borders, start on
them and fit inside one tile. The whole model checkpointed in tiles must equal it checkpointed per layer,
also with activation offload, and what the tiled mixer keeps for backward must be only its inputs.
"""

from __future__ import annotations

import pytest
import torch
import verl_moe.models as vm
from tiny_models import packed_inputs, randomize_norms, tiny_qwen3_5_moe_text
from torch.distributed._composable import checkpoint
from verl_moe.models.fsdp_plan import checkpoint_in_tiles, decoder_layers, offload_activations
from verl_moe.models.qwen3_5_moe.gated_deltanet import tile_span
from verl_moe.ops.compare import assert_rel_rms

TOL = 1e-12  # fp64
MODEL_TOL = 1e-9  # fp64 after four layers; dt_bias's gradient sums many cancelling terms (|d| ~1e-9)


def _mixer():
    torch.manual_seed(0)
    model = vm.build(tiny_qwen3_5_moe_text(), dtype=torch.float64)
    return model.model.layers[0].linear_attn


def _run(mixer, x, cu):
    x = x.detach().requires_grad_(True)
    y = mixer(x, cu)
    weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    (y * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in mixer.named_parameters()}
    mixer.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


@pytest.mark.parametrize(
    "lengths, tile",
    [
        ([50], 16),  # one sequence over four tiles (the last one short)
        ([7, 2, 21, 1, 19], 8),  # borders inside, at and around sequence starts; a 1-token sequence
        ([3, 3, 10], 4),  # tiles shorter than the conv's context reach back into the sequence only
        ([9, 23], 9),  # a border exactly at a sequence start
    ],
)
def test_tiled_gated_delta_net_equals_untiled(lengths, tile):
    mixer = _mixer()
    T = sum(lengths)
    x = torch.randn(1, T, mixer.out_proj.out_features, dtype=torch.float64)
    cu = None if len(lengths) == 1 else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    want = _run(mixer, x, cu)
    mixer.checkpoint_tile_tokens = tile
    got = _run(mixer, x, cu)
    assert_rel_rms("output", want[0], got[0], TOL)
    assert_rel_rms("d x", want[1], got[1], TOL)
    for name in want[2]:
        assert_rel_rms(f"d {name}", want[2][name], got[2][name], TOL)


def test_tile_spans_cover_the_row_once():
    """Every token is in exactly one tile; the conv context stays inside the token's own sequence."""
    bounds = [0, 7, 9, 30, 31, 50]
    starts = range(0, 50, 8)
    covered = []
    for start in starts:
        span = tile_span(bounds, start, min(start + 8, 50), 3)
        covered += range(span.start, span.stop)
        first = max(b for b in bounds if b <= start)
        assert span.start - span.prefix >= first and span.prefix <= 3
        assert span.gdn_cu[-1] == span.stop - span.start and span.conv_cu[-1] == span.gdn_cu[-1] + span.prefix
        assert span.continues == (first < start) and span.carries_on == (span.stop not in bounds)
    assert covered == list(range(50))


def test_tiled_mixer_keeps_only_its_inputs():
    """Between forward and backward the tiled mixer holds its tiles' inputs (views of x) and carried states:
    under the untiled mixer autograd keeps every projection, the conv output and the recurrence's."""
    mixer = _mixer()
    x = torch.randn(1, 48, mixer.out_proj.out_features, dtype=torch.float64, requires_grad=True)

    def saved_bytes():
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            mixer(x, None).sum().backward()
        params = {p.untyped_storage().data_ptr() for p in mixer.parameters()}
        return sum(n for ptr, n in storages.items() if ptr not in params)

    untiled = saved_bytes()
    mixer.checkpoint_tile_tokens = 16
    tiled = saved_bytes()
    state = mixer.num_v_heads * mixer.head_k_dim * mixer.head_v_dim * 8
    assert tiled <= x.numel() * 8 + 2 * state, (tiled, untiled)
    assert untiled > 4 * tiled


def _tiny_model(units: str, offload: bool):
    torch.manual_seed(0)
    config = tiny_qwen3_5_moe_text(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])
    model = vm.build(config, dtype=torch.float64, ops=vm.OpsConfig(router_dtype="fp64"))  # no fp32 rounding
    randomize_norms(model)
    if offload:
        offload_activations(model)
    for layer in decoder_layers(model):
        checkpoint_in_tiles(layer, 8) if units == "tiles" else checkpoint(layer)
    return model


@pytest.mark.parametrize("offload", [False, True], ids=["no-offload", "offload"])
def test_model_in_tiles_equals_per_layer_checkpointing(offload):
    grads = {}
    for units in ("layer", "tiles"):
        model = _tiny_model(units, offload)
        ids, pos, cu = packed_inputs([13, 4, 20], seed=0)
        hidden = model(ids, pos, cu_seqlens=cu).last_hidden_state
        model.logits(hidden).logsumexp(-1).mean().backward()
        grads[units] = {n: p.grad for n, p in model.named_parameters()}
    for name, want in grads["layer"].items():
        assert_rel_rms(f"d {name}", want, grads["tiles"][name], MODEL_TOL)


@pytest.mark.gpu
def test_gpu_packed_rows_in_tiles_with_offload_equal_per_layer_checkpointing():
    """The same on the accelerator in fp32 with its kernels (attention: the torch reference, flash takes
    no fp32): tiles made from host offsets (`ops.varlen.offsets_tensor`'s pinned copy), sequences
    crossing tile borders, the offload's pinned copies and side stream."""
    from verl_moe.ops import device

    dev = device.current_device()
    grads = {}
    for units in ("layer", "tiles"):
        torch.manual_seed(0)
        config = tiny_qwen3_5_moe_text(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])
        model = vm.build(config, dtype=torch.float32, device=dev, ops=vm.OpsConfig(attention="torch"))
        randomize_norms(model)
        if units == "tiles":
            offload_activations(model)
        for layer in decoder_layers(model):
            checkpoint_in_tiles(layer, 64) if units == "tiles" else checkpoint(layer)
        ids, pos, cu = (t.to(dev) for t in packed_inputs([100, 37, 150], seed=0))
        hidden = model(ids, pos, cu_seqlens=cu).last_hidden_state
        model.logits(hidden).logsumexp(-1).mean().backward()
        grads[units] = {n: p.grad for n, p in model.named_parameters()}
    # fp32 round-off (the recurrence restarts its chunks at tile borders): every gradient within 1e-5 of
    # the model's largest; relative bounds fail on the decay path's gradients, which sum cancelling terms
    # to ~1e-8 of it. A state or context not carried across a border is off by the gradient itself.
    scale = max(g.abs().max().item() for g in grads["layer"].values())
    worst = max((grads["tiles"][n] - g).abs().max().item() for n, g in grads["layer"].items())
    assert worst <= 1e-5 * scale, (worst, scale)
