"""Tiled MoE block (`MoeBlock.checkpoint_tile_tokens`): the layer's flat tokens in contiguous tiles,
each tile one activation-checkpoint unit.

- Tiled (tiles that do not divide the 37 tokens, one tile of all 37, a tile longer than the input,
  tiles that divide 2 x 16 tokens) equals the untiled block: output, router logits, gradients of the input and of every
  weight (router, experts, shared expert and its gate).
- The tiles are checkpoint units: what autograd saves outside the checkpoints is the tile inputs
  only (views of the input, <= 5 % of the bytes the untiled block saves), and the backward
  recomputes one tile at a time (each tile's recomputation is followed by its input gradient before
  the next tile is recomputed).
- Router replay through a tiled block: an R3-style `_LayerSlot` with targets for the whole layer
  routes exactly the ids the untiled block routes (the targets where valid, the free ids elsewhere)
  with the same gradients; recording through tiles (forward and its backward recomputation) gives
  the untiled [T, TOPK] ids, and `RouterReplay.recorded` on a tiled model gives the untiled nested
  routed_experts.
- Under expert parallelism the block runs one tile, still checkpointed.

Tolerances (fp32, torch ops on CPU): tiled vs untiled rel RMS 1e-6 (only the order of the weight
gradients' sums over tokens differs); saved bytes tiled <= 5 % of untiled.
"""

from __future__ import annotations

import copy

import pytest
import torch
import verl_moe.models as vm
from tiny_models import packed_inputs, tiny_qwen3_5_moe_text, tiny_qwen3_moe
from verl_moe.engines.batch import PackedBatch
from verl_moe.engines.router_replay import RECORD, REPLAY, RouterReplay, _LayerSlot
from verl_moe.models.layers import MoeBlock
from verl_moe.ops.compare import assert_rel_rms

N, TOL = 37, 1e-6
LENGTHS = [13, 9, 15]  # 37 packed tokens


def _block(seed: int = 0) -> MoeBlock:
    torch.manual_seed(seed)
    block = vm.build(tiny_qwen3_5_moe_text()).model.layers[0].mlp
    with torch.no_grad():  # a router of larger scale than the init's, so routing varies per token
        block.gate.weight.normal_(0.0, 0.5)
    return block


def _run(block: MoeBlock, x: torch.Tensor, grad_out: torch.Tensor):
    """(out, logits, {name: grad} of the input and every parameter) of one forward + backward."""
    x = x.detach().clone().requires_grad_()
    for p in block.parameters():
        p.grad = None
    out, logits = block(x)
    ((out * grad_out).sum() + logits.square().sum()).backward()
    grads = {"x": x.grad, **{name: p.grad for name, p in block.named_parameters()}}
    return out.detach(), logits.detach(), grads


def _in_backward() -> bool:
    """True inside autograd's backward (activation checkpointing's recomputation)."""
    return torch._C._current_graph_task_id() != -1


@pytest.mark.parametrize(
    "shape, tile",
    [((1, N), 8), ((1, N), 16), ((1, N), N), ((1, N), 64), ((2, 16), 8)],
    ids=["N37-tile8", "N37-tile16", "N37-tile37", "N37-tile64", "B2xT16-tile8"],
)
def test_tiled_equals_untiled(shape, tile):
    block = _block()
    tiled = copy.deepcopy(block)
    tiled.checkpoint_tile_tokens = tile
    x, grad_out = torch.randn(*shape, 64), torch.randn(*shape, 64)
    out, logits, grads = _run(block, x, grad_out)
    out_t, logits_t, grads_t = _run(tiled, x, grad_out)
    assert out_t.shape == out.shape == x.shape and logits_t.shape == logits.shape == (x[..., 0].numel(), 4)
    assert logits_t.dtype == logits.dtype
    assert_rel_rms("output", out, out_t, TOL)
    assert_rel_rms("router logits", logits, logits_t, TOL)
    assert sorted(grads) == sorted(grads_t) and {"gate.weight", "experts.gate_up_proj"} <= set(grads)
    assert {"shared_expert_gate.weight", "shared_expert.down_proj.weight"} <= set(grads)
    for name, g in grads.items():
        assert g is not None and g.abs().sum() > 0, name
        assert_rel_rms(f"d {name}", g, grads_t[name], TOL)


def test_tiles_are_checkpoint_units():
    tile = 8
    block = _block()
    x = torch.randn(1, N, 64, requires_grad=True)

    def saved(b: MoeBlock) -> list[torch.Tensor]:
        tensors = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: tensors.append(t) or t, lambda t: t):
            b(x)
        return tensors

    def nbytes(tensors: list[torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    untiled = saved(block)
    block.checkpoint_tile_tokens = tile
    tiled = saved(block)
    sizes = [min(tile, N - s) for s in range(0, N, tile)]
    # outside the checkpoints autograd keeps the tile inputs only: views of x, no new memory
    assert [t.shape for t in tiled] == [(n, 64) for n in sizes]
    assert all(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in tiled)
    assert nbytes(tiled) == x.numel() * x.element_size() <= 0.05 * nbytes(untiled), (nbytes(tiled), nbytes(untiled))

    # backward: each tile is recomputed, then its input gradient completes, before the next tile
    events = []

    def on_experts(module, args):
        if _in_backward():
            events.append(("recompute", args[0].shape[0]))

    def on_gate(module, args):
        if not _in_backward():
            n = args[0].shape[0]
            args[0].register_hook(lambda g, n=n: events.append(("grad", n)))

    handles = [block.experts.register_forward_pre_hook(on_experts), block.gate.register_forward_pre_hook(on_gate)]
    try:
        out, _ = block(x)
        out.square().sum().backward()
    finally:
        for h in handles:
            h.remove()
    # backward visits the last tile first
    assert events == [e for n in sizes[::-1] for e in (("recompute", n), ("grad", n))], events


def _targets(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """R3-style replay ids [N, TOPK] (distinct per row) and valid [N, 1]: a few rows repeat an id
    (the zeros verl leaves where the rollout recorded nothing) and are routed freely."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(N)])
    ids[::7] = 0
    valid = (ids[:, :1] != ids[:, 1:]).all(dim=-1, keepdim=True)
    return ids, valid


def _routed(block: MoeBlock, slot: _LayerSlot, x, grad_out):
    """_run with `slot` as the router override, plus the ids the experts got in forward, in token order."""
    block.gate.override = slot
    calls = []
    handle = block.experts.register_forward_pre_hook(
        lambda m, args: calls.append(args[1].detach().clone()) if not _in_backward() else None
    )
    try:
        result = _run(block, x, grad_out)
    finally:
        handle.remove()
        block.gate.override = None
    return (*result, torch.cat(calls))


@pytest.mark.parametrize("tile", [8, 37])
def test_router_replay_through_tiles(tile):
    block = _block()
    tiled = copy.deepcopy(block)
    tiled.checkpoint_tile_tokens = tile
    x, grad_out = torch.randn(1, N, 64), torch.randn(1, N, 64)
    targets, valid = _targets(seed=1)

    # recording: the first call per tile (the forward), not the backward recomputation
    slot = _LayerSlot()
    slot.recording = True
    *_, free = _routed(block, slot, x, grad_out)
    recorded = slot.recorded
    assert torch.equal(recorded, free) and recorded.shape == (N, 2)
    slot.clear()
    slot.recording = True
    calls = []

    def counted(free_idx, rows=None):
        calls.append(rows)
        return slot(free_idx, rows)

    *_, free_t = _routed(tiled, counted, x, grad_out)
    assert len(calls) == 2 * len(range(0, N, tile))  # forward + recomputation per tile
    assert torch.equal(free_t, free) and torch.equal(slot.recorded, recorded)
    slot.clear()
    assert slot.recorded is None

    # replay: targets where valid, free elsewhere; tiled equals untiled
    slot.targets, slot.valid = targets, valid
    out, logits, grads, used = _routed(block, slot, x, grad_out)
    out_t, logits_t, grads_t, used_t = _routed(tiled, slot, x, grad_out)
    expected = torch.where(valid, targets, free)
    assert not torch.equal(expected, free)  # replay changes the routing of some tokens
    assert torch.equal(used, expected) and torch.equal(used_t, expected)
    assert_rel_rms("output", out, out_t, TOL)
    assert_rel_rms("router logits", logits, logits_t, TOL)
    for name, g in grads.items():
        assert_rel_rms(f"d {name}", g, grads_t[name], TOL)

    slot.targets, slot.valid = targets[:-1], valid[:-1]  # one row short: the last tile's shape check
    with pytest.raises(ValueError, match="routed_experts do not match the tokens"):
        _routed(tiled, slot, x, grad_out)


def test_router_replay_recorded_on_a_tiled_model():
    torch.manual_seed(0)
    model = vm.build(tiny_qwen3_moe())  # attention layers (fast on CPU), the middle one dense
    moe = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoeBlock)]
    assert len(moe) == 2
    with torch.no_grad():
        for block in moe:
            block.gate.weight.normal_(0.0, 0.5)
    ids, pos, cu = packed_inputs(LENGTHS)
    packed = PackedBatch(ids, pos, cu, ids[0].roll(-1), torch.ones(ids.shape[1]), cu.long())
    replay = RouterReplay(model)

    def record() -> torch.Tensor:
        with replay.armed(RECORD, None, packed, None):
            hidden = model(ids, pos, cu_seqlens=cu).last_hidden_state
            hidden.square().sum().backward()  # the recomputation calls the slots again
            return replay.recorded(packed, None)

    untiled = record()
    for block in moe:
        block.checkpoint_tile_tokens = 8
    tiled = record()
    assert tiled.values().shape == (N, 3, 2) and tiled.values().dtype == torch.int16
    assert torch.equal(tiled.offsets(), untiled.offsets()) and torch.equal(tiled.values(), untiled.values())

    # replaying the recorded ids through the tiled model is free routing, bitwise
    with torch.no_grad():
        free = model(ids, pos, cu_seqlens=cu).last_hidden_state
        with replay.armed(REPLAY, {"routed_experts": tiled}, packed, None):
            assert torch.equal(model(ids, pos, cu_seqlens=cu).last_hidden_state, free)


def test_expert_parallel_runs_one_checkpointed_tile(monkeypatch):
    block = _block()
    block.checkpoint_tile_tokens = 8
    block.experts.expert_parallel = object()  # only its presence is read by the block
    calls = []

    def experts(hidden, topk_idx, topk_weight):  # the local experts with this block's weights
        calls.append((hidden.shape[0], _in_backward()))
        gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
        return block.experts.ops.experts(hidden, gate_up, down, topk_idx, topk_weight)

    monkeypatch.setattr(block.experts, "forward", experts)
    x = torch.randn(1, N, 64, requires_grad=True)
    out, _ = block(x)
    out.square().sum().backward()
    assert calls == [(N, False), (N, True)]  # one tile, recomputed once in backward


def test_align_router_recorder_joins_the_tiles():
    """`verl-moe align`'s recorder of expert ids (tools/align/backends/engine.py) keeps each tile's first
    call: through tiles, forward and the backward's recomputation, it gives the untiled ids."""
    from verl_moe.tools.align.backends.engine import RouterRecorder

    torch.manual_seed(0)
    model = vm.build(tiny_qwen3_5_moe_text())
    ids, pos, cu = packed_inputs(LENGTHS)
    recorder = RouterRecorder(model)
    with torch.no_grad():
        model(ids, pos, cu_seqlens=cu)
    want = recorder.take()
    for block in (m for m in model.modules() if isinstance(m, MoeBlock)):
        block.checkpoint_tile_tokens = 8
    model(ids, pos, cu_seqlens=cu).last_hidden_state.sum().backward()
    got = recorder.take()
    assert len(got) == len(want) == model.arch.num_hidden_layers
    for layer, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"layer {layer}"
