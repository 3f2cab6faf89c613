"""Both engines accept verl's activation-offload switches and train as without them, bit for bit.

On 2 gloo ranks, per engine: one optimizer step (two micro-batches per rank, per-layer checkpointing on,
verl's default) with the switch off, then on: fsdp2 reads `model.enable_activation_offload`, veomni
`enable_async_activation_offload` (with VeOmni's module-list option naming the decoder layers). Offload only
moves saved tensors to host memory and back, and moves the checkpoint units inside the layers (mixer and MoE
block; these micro-batches are shorter than one 16,384-token tile, whose splitting `tests/models/
test_checkpoint_tiles.py` checks), which recompute the same ops: the loss, the gradient norm and every
weight after the step must be equal. The refusals of what the engines cannot honour are checked before any build.
"""

from __future__ import annotations

import hashlib
import re
from types import SimpleNamespace

import pytest
import torch
from engine_setup import (
    build_engine,
    build_veomni_engine,
    fixed_ppo_batch,
    grpo_actor_config,
    ppo_loss_fn,
    tiny_config,
    write_tiny_model,
)
from verl_moe.engines.config import MoeFsdp2EngineConfig, MoeVeOmniEngineConfig, validate_engine_config

BUILDERS = {
    "fsdp2": lambda path, on: build_engine(path, model={"enable_activation_offload": on}),
    "veomni": lambda path, on: build_veomni_engine(
        path, enable_async_activation_offload=on, activation_offload_modules=["model.layers.{*}"] if on else []
    ),
}


def _step(engine, rank: int, world_size: int) -> dict:
    data = fixed_ppo_batch(8, 5, 6, seed=3, rank=rank, world_size=world_size)
    with engine.train_mode():
        out = engine.train_batch(data, ppo_loss_fn(grpo_actor_config()))
    weights = hashlib.sha256()
    gen, _ = engine.get_per_tensor_param(layout="hf")
    for name, tensor in gen:
        weights.update(name.encode() + tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    offload = engine.activation_offload
    return {
        "loss": out["loss"],
        "grad_norm": out["metrics"]["grad_norm"],
        "weights": weights.hexdigest(),
        "packed": None if offload is None else offload.packed_tensors,
        "offloaded_layers": None if offload is None else list(offload.layer_indices),
    }


def train_with_and_without(rank: int, world_size: int, path: str) -> dict:
    return {
        kind: [_step(build(path, on), rank, world_size) for on in (False, True)] for kind, build in BUILDERS.items()
    }


@pytest.mark.dist
def test_both_engines_train_equal_with_offload(tmp_path):
    from forked import shared_server

    path = write_tiny_model(str(tmp_path / "model"))
    for rank_result in shared_server().run(__name__, "train_with_and_without", 2, path, timeout=120).check():
        for kind, (off, on) in rank_result.items():
            assert off["packed"] is None and on["packed"] > 0, kind
            assert on["offloaded_layers"] == [0, 1], kind  # the last of the 3 layers keeps its inputs
            for key in ("loss", "grad_norm", "weights"):
                assert on[key] == off[key], (kind, key)


def _model_config(offload: bool = False):
    return SimpleNamespace(hf_config=tiny_config(), lora_rank=0, enable_activation_offload=offload)


@pytest.mark.parametrize(
    ("model_offload", "engine_fields", "message"),
    [
        (True, {}, "model.enable_activation_offload is not supported by MoeVeOmniEngine"),
        (False, dict(activation_offload_host_cache_limit_gb=0.0), "activation_offload_host_cache_limit_gb=0.0"),
        (
            False,
            dict(enable_async_activation_offload=True, activation_offload_modules=["model.visual.blocks.*"]),
            "activation_offload_modules: 'model.visual.blocks.*' matches no decoder layer",
        ),
    ],
)
def test_veomni_offload_options_it_cannot_honour_raise(model_offload, engine_fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_engine_config(_model_config(model_offload), MoeVeOmniEngineConfig(**engine_fields), 2)


def test_offload_switches_pass_validation():
    validate_engine_config(_model_config(offload=True), MoeFsdp2EngineConfig(), 2)
    veomni = MoeVeOmniEngineConfig(enable_async_activation_offload=True, activation_offload_modules=["model.layers.1"])
    validate_engine_config(_model_config(), veomni, 2)
