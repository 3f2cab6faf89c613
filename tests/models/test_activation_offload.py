"""Activation offload (`models/activation_offload.py`) on the tiny Qwen3.5-MoE, CPU, fp32.

Tolerance: none. Offload copies saved storages out and back bit for bit and hands backward each tensor with its
original sizes, strides and offset, so backward runs the same operations and every gradient must equal the
run without offload exactly (with and without per-layer checkpointing, over two graphs alive at once).
The host test watches what the hooks packed: per offloaded layer, host copies of exactly the layer's
tensor inputs (distinct storage, pinned on an accelerator) while the device inputs themselves are freed;
without offload autograd keeps them.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import verl_moe.models as vm
from tiny_models import packed_inputs, randomize_norms, tiny_qwen3_5_moe_text
from torch import nn
from torch.distributed._composable import checkpoint
from verl_moe.models.activation_offload import ActivationOffload, select_layers
from verl_moe.models.fsdp_plan import decoder_layers, offload_activations
from verl_moe.ops import device

DEVICE = device.current_device()  # the offload moves what lives on this process's device (the host on CPU)


def _model(checkpointing: bool, offload: bool, **options):
    torch.manual_seed(0)
    config = tiny_qwen3_5_moe_text(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])
    model = vm.build(config, device=DEVICE)
    randomize_norms(model)
    handle = offload_activations(model, **options) if offload else None
    # copies finish before the next layer starts, so which device tensors are dropped is deterministic
    decoder_layers(model)[-1].register_forward_pre_hook(lambda m, a: device.synchronize(), prepend=True)
    if checkpointing:
        for layer in decoder_layers(model):
            checkpoint(layer)
    return model, handle


def _loss(model, seed: int) -> torch.Tensor:
    ids, pos, cu = (t.to(DEVICE) for t in packed_inputs([5, 9, 2], seed=seed))
    hidden = model(ids, pos, cu_seqlens=cu).last_hidden_state
    return model.logits(hidden).float().logsumexp(-1).mean()


def _grads(checkpointing: bool, offload: bool) -> tuple[dict, ActivationOffload | None]:
    """Two micro-batches whose graphs are alive together (two forwards, one backward), then a third alone."""
    model, handle = _model(checkpointing, offload)
    (_loss(model, 0) + _loss(model, 1)).backward()
    _loss(model, 2).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, handle


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointed", "not-checkpointed"])
def test_gradients_bitwise_equal_to_no_offload(checkpointing):
    want, _ = _grads(checkpointing, offload=False)
    got, handle = _grads(checkpointing, offload=True)
    assert handle.packed_tensors > 0 and handle.layer_indices == (0, 1, 2)
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def _watch_inputs(model) -> list[dict]:
    """Per decoder layer: weak references to its hidden / residual inputs, the values of its tensor inputs
    (all, and those no earlier layer took: cos / sin go to every layer) and their storages (a pre-hook)."""
    seen = [{} for _ in decoder_layers(model)]
    earlier = []

    def hook(i, module, args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        seen[i].update(
            # hidden, residual (None at the first layer): nothing but the layer's saved inputs keeps them
            refs=[weakref.ref(t) for t in args[:2] if t is not None],
            values=[t.detach().clone() for t in tensors],
            fresh=[t.detach().clone() for t in tensors if not any(t is e() for e in earlier)],
            storages={t.untyped_storage().data_ptr() for t in tensors},
        )
        earlier.extend(weakref.ref(t) for t in tensors)

    for i, layer in enumerate(decoder_layers(model)):
        layer.register_forward_pre_hook(lambda m, a, i=i: hook(i, m, a))
    return seen


def test_saved_inputs_live_on_the_host():
    model, handle = _model(checkpointing=True, offload=True)
    seen = _watch_inputs(model)
    loss = _loss(model, 0)
    gc.collect()
    n = len(seen)
    storages = {}  # host copies are whole storages, shared by the tensors saved in one
    for i in range(n - 1):
        held = handle.held(i)
        # checkpointing saves nothing inside the layer: the hooks packed exactly its tensor inputs (those an
        # earlier layer also took stay on the device: copying them again would free nothing)
        assert len(held) == len(seen[i]["fresh"]) and handle.on_device(i) == 0, i
        for host, value in zip(held, seen[i]["fresh"]):
            assert torch.equal(host, value), i
            assert host.untyped_storage().data_ptr() not in seen[i]["storages"], i
            assert host.device.type == "cpu" and host.is_pinned() == device.is_accelerator(), i
            storages[host.untyped_storage().data_ptr()] = host.untyped_storage().nbytes()
        # the device inputs are gone: autograd holds the host copies only
        assert all(ref() is None for ref in seen[i]["refs"]), i
    assert sum(storages.values()) == handle.packed_bytes == handle.host_bytes
    assert handle.held(n - 1) == [] and any(ref() is not None for ref in seen[n - 1]["refs"])
    loss.backward()
    assert all(handle.held(i) == [] for i in range(n))

    control, _ = _model(checkpointing=True, offload=False)
    seen = _watch_inputs(control)
    loss = _loss(control, 0)
    gc.collect()
    assert all(ref() is not None for ref in seen[1]["refs"]), "without offload autograd keeps the layer inputs"


def test_fused_norm_residual_sums_leave_the_device(monkeypatch):
    """Without checkpointing each decoder layer's norms save the residual sum h = x + residual; the
    fused norm (triton) saves its own output h. Once the offload dropped its device copy nothing else
    may hold h: the sums made by the offloaded layers are freed by the end of the forward. (The last
    layer's and the final norm's live on as autograd's saved outputs, without their Python objects.)
    The fused norm once saved a view of h, which the offload took for a leaf of the caller's and kept
    on the device (a [T, hidden] tensor per layer)."""
    from verl_moe.ops.norm import fused

    sums, kernel = [], fused.rms_norm_fwd

    def spy(*args):
        y, h, rstd = kernel(*args)
        if h is not None:
            sums.append(weakref.ref(h))
        return y, h, rstd

    monkeypatch.setattr(fused, "rms_norm_fwd", spy)
    torch.manual_seed(0)
    config = tiny_qwen3_5_moe_text(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])
    model = vm.build(config, device=DEVICE, ops=vm.OpsConfig(norm="triton"))
    offload_activations(model)
    decoder_layers(model)[-1].register_forward_pre_hook(lambda m, a: device.synchronize(), prepend=True)
    loss = _loss(model, 0)
    gc.collect()
    alive = [ref() is not None for ref in sums]
    # layer 0 makes one sum (its input has no residual), layers 1-3 two each, the final norm one
    assert len(alive) == 8 and not any(alive[:5]), alive
    loss.backward()


class _SavesViewOfOutput(torch.autograd.Function):
    """out = 2 x, saving a view of out made inside forward (without grad), as some kernels' wrappers do."""

    @staticmethod
    def forward(ctx, x):
        out = x * 2
        ctx.save_for_backward(out.view(-1))
        return out

    @staticmethod
    def backward(ctx, grad):
        (flat,) = ctx.saved_tensors
        return grad * 2 + 0 * flat.view(grad.shape)


def test_a_saved_view_of_an_output_is_offloaded():
    """Such a view reads as a leaf that requires grad; the offload must still move it (and free the
    output on the device), telling it from the caller's own leaves by its base."""

    class Layer(nn.Module):
        def forward(self, x):
            return _SavesViewOfOutput.apply(x)

    layers = [Layer(), Layer()]
    handle = ActivationOffload(layers)
    x = torch.randn(3, 4, device=DEVICE, requires_grad=True)
    out = layers[1](layers[0](x) + 0)
    device.synchronize()
    held = handle.held(0)
    assert len(held) == 1 and torch.equal(held[0], (x * 2).detach().view(-1)) and handle.on_device(0) == 0
    out.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 4.0))


class _SavesStridedViews(torch.autograd.Function):
    """Saves a transposed slice and a column slice of one buffer; backward records what it got back."""

    got = []

    @staticmethod
    def forward(ctx, x):
        buffer = torch.cat([x, x * 3], dim=-1)  # [T, 2D]: both saved views live in this storage
        ctx.save_for_backward(buffer[1:, : x.shape[-1]].t(), buffer[:, 1::2])
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        _SavesStridedViews.got = [
            (t.shape, t.stride(), t.storage_offset(), t.untyped_storage().nbytes(), t.clone())
            for t in ctx.saved_tensors
        ]
        return grad * 2


def test_restored_tensors_keep_their_geometry():
    """Backward gets each saved tensor back with the sizes, strides and storage offset it had, in one storage
    of the original's size that both views share: backward kernels see the same layouts as without offload
    (what makes the gradients bitwise equal by construction), and the storage crosses once."""

    class Layer(nn.Module):
        def forward(self, x):
            return _SavesStridedViews.apply(x)

    layers = [Layer(), Layer()]
    handle = ActivationOffload(layers)
    x = torch.randn(5, 4, device=DEVICE, requires_grad=True)
    buffer = torch.cat([x, x * 3], dim=-1).detach()
    want = [buffer[1:, :4].t(), buffer[:, 1::2]]
    out = layers[1](layers[0](x) + 0)
    device.synchronize()
    held = handle.held(0)
    assert len(held) == 2 and handle.on_device(0) == 0
    assert len({h.untyped_storage().data_ptr() for h in held}) == 1 and handle.packed_bytes == buffer.nbytes
    out.sum().backward()
    for (shape, stride, offset, nbytes, value), w in zip(_SavesStridedViews.got, want, strict=True):
        assert (shape, stride, offset, nbytes) == (w.shape, w.stride(), w.storage_offset(), buffer.nbytes)
        assert torch.equal(value, w)


def test_layer_selection():
    names = [f"model.layers.{i}" for i in range(4)]
    assert select_layers(names, []) == [0, 1, 2, 3]
    assert select_layers(names, ["model.layers.{*}"]) == [0, 1, 2, 3]
    assert select_layers(names, ["model.layers.1", "model.layers.2"]) == [1, 2]
    assert select_layers(names, ["model.*.0"]) == [0]
    for bad in ("model.visual.blocks.*", "model.layers", "model.layers.*.mlp"):
        with pytest.raises(ValueError, match="activation_offload_modules: .* matches no decoder layer"):
            select_layers(names, [bad])
    model, handle = _model(checkpointing=True, offload=True, modules=("model.layers.1",))
    seen = _watch_inputs(model)
    loss = _loss(model, 0)
    assert handle.layer_indices == (1,)
    assert handle.held(0) == [] and len(handle.held(1)) == len(seen[1]["values"])
    loss.backward()


def test_bad_options():
    layers = decoder_layers(_model(checkpointing=False, offload=False)[0])
    with pytest.raises(ValueError, match=r"indices \[7\]"):
        ActivationOffload(layers, offloaded=[7])
    with pytest.raises(ValueError, match="prefetch_layers=-1"):
        ActivationOffload(layers, prefetch_layers=-1)


@pytest.mark.parametrize("prefetch_layers", [1, 0])
def test_copies_back_are_issued_ahead_of_each_layer_backward(prefetch_layers):
    """With prefetch, every offloaded layer's copy back is issued before backward first needs the layer
    (the top one when the last layer's output gradient arrives, each other at the layer above it);
    without, inside that first need."""
    model, handle = _model(checkpointing=True, offload=True, prefetch_layers=prefetch_layers)
    events = []
    fetch, restore = handle._fetch, handle._restore
    handle._fetch = lambda block: (events.append(("fetch", block.pos)), fetch(block))[1]
    handle._restore = lambda saved: (events.append(("unpack", saved.block.pos)), restore(saved))[1]
    _loss(model, 0).backward()
    for pos in range(len(handle.layer_indices)):
        first_fetch, first_unpack = events.index(("fetch", pos)), events.index(("unpack", pos))
        assert (first_fetch < first_unpack) == (prefetch_layers > 0), (pos, events)


def test_weights_stay_out_of_host_memory():
    """Without checkpointing the hooks see every saved tensor, weights and views of them included: those
    stay where they are (FSDP owns their storage), only activations are copied."""
    model, handle = _model(checkpointing=False, offload=True)
    loss = _loss(model, 0)
    views = []
    for p in decoder_layers(model)[0].parameters():
        for w in p.unbind(0) if p.dim() == 3 else [p]:  # an expert's slice of the fused weights
            views += [w, w.transpose(-1, -2)] if w.dim() == 2 else [w]
    held = handle.held(0)
    assert held and not any(h.shape == w.shape and torch.equal(h, w) for h in held for w in views)
    loss.backward()
