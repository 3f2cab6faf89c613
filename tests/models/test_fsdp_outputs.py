"""What the FSDP2-sharded decoder layers return: no view tensors (FSDP2 warns about each one, since an
in-place op on a view would bypass the pre-backward hook it puts on the output), and gradients equal
to the unsharded model's.

Tolerances: fp64 with the torch ops, gradients rel RMS <= 1e-10 against the unsharded model (rounding
only; the ranks' reduce-scatter averages two equal gradients); fp32 with the Triton norm and experts
(the accelerator defaults, in the interpreter) rel RMS <= 1e-5.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import verl_moe.models as vm
from dist import spawn
from tiny_models import inputs, randomize_norms, tiny_qwen3_5_moe_text, tiny_qwen3_moe
from torch.distributed.device_mesh import init_device_mesh
from verl_moe.models import layers
from verl_moe.models.fsdp_plan import FsdpPlan, fully_shard_model
from verl_moe.models.layers import MoeBlock
from verl_moe.ops.compare import assert_rel_rms

VIEW_WARNING = "returned a view tensor"

CASES = {
    # shared expert; GatedDeltaNet and attention layers
    "qwen3_5_moe": dict(config=tiny_qwen3_5_moe_text, dtype=torch.float64, tol=1e-10),
    # routed experts only, and a dense layer
    "qwen3_moe": dict(config=tiny_qwen3_moe, dtype=torch.float64, tol=1e-10),
    # checkpointed inside the layers, the MoE block in tiles of 5 tokens (its output is their cat)
    "qwen3_5_moe_tiles": dict(config=tiny_qwen3_5_moe_text, dtype=torch.float64, tol=1e-10, tile_tokens=5),
    # the accelerator defaults: Triton norm (its fused residual sum) and Triton experts
    "qwen3_5_moe_triton": dict(
        config=tiny_qwen3_5_moe_text,
        dtype=torch.float32,
        tol=1e-5,
        ops=vm.OpsConfig(norm="triton", experts="triton", router_dtype="model"),
    ),
}


def _loss(model, ids, pos) -> torch.Tensor:
    hidden = model(ids, pos).last_hidden_state
    weight = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(3), dtype=hidden.dtype)
    return (hidden * weight).sum()


def _sharded_step_matches_plain(rank: int, world_size: int) -> None:
    for name, case in CASES.items():
        ops = case.get("ops", vm.OpsConfig(router_dtype="model"))
        torch.manual_seed(0)
        model = vm.build(case["config"](), dtype=case["dtype"], ops=ops)
        randomize_norms(model)
        ids, pos = inputs(2, 12)

        _loss(model, ids, pos).backward()
        reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)

        tiles = case.get("tile_tokens", 0)
        plan = FsdpPlan(
            mesh=init_device_mesh("cpu", (world_size,)),
            activation_checkpointing=tiles > 0,
            checkpoint_tile_tokens=tiles,
        )
        fully_shard_model(model, model, plan)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _loss(model, ids, pos).backward()  # every rank the same batch: the averaged gradient is the plain one
        views = [str(w.message).split(".")[0] for w in caught if VIEW_WARNING in str(w.message)]
        assert not views, (name, views)

        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        assert sorted(grads) == sorted(reference), name
        for param_name, ref in reference.items():
            assert_rel_rms(f"{name} {param_name}", ref, grads[param_name], case["tol"])


@pytest.mark.dist
def test_sharded_layers_return_no_views():
    """2 gloo ranks, every case: no FSDP2 view warning, gradients equal to the unsharded model's."""
    spawn(_sharded_step_matches_plain, 2)


def _block_step(block, x, grad_out) -> tuple[torch.Tensor, dict]:
    x.grad = None
    block.zero_grad(set_to_none=True)
    out, _ = block(x)
    out.backward(grad_out)
    return out, {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in block.named_parameters()}}


@pytest.mark.parametrize("tile_tokens", [0, 5])
def test_moe_block_output_is_no_view_and_keeps_gradients(tile_tokens, monkeypatch):
    """The block's [B, T, D] output is a tensor of its own (no `_base`), and the gradients reaching
    its weights and input are bitwise those of the same block returning a plain view."""
    torch.manual_seed(0)
    block = vm.build(tiny_qwen3_5_moe_text()).model.layers[0].mlp
    assert isinstance(block, MoeBlock)
    block.checkpoint_tile_tokens = tile_tokens
    D = block.gate.weight.shape[1]
    x = torch.randn(2, 12, D, requires_grad=True)
    grad_out = torch.randn(2, 12, D)

    out, got = _block_step(block, x, grad_out)
    assert out._base is None

    monkeypatch.setattr(layers, "unflatten_tokens", lambda flat, shape: flat.view(shape))
    view, expected = _block_step(block, x, grad_out)
    assert view._base is not None  # the reference really is the view
    assert torch.equal(out, view)
    for key, g in expected.items():
        assert torch.equal(got[key], g), key
