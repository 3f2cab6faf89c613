"""Checkpoints and placement for our FSDP2 engines: plain functions over sharded modules.

Layout of a checkpoint folder `<path>/`:
    dcp/                    torch.distributed.checkpoint of {"model": ..., "optimizer": ...}
                            (sharded state dicts; any rank count can read it back)
    extra_rank{r}.pt        per rank: LR scheduler state, RNG states (torch, device, python,
                            numpy), global step; resume needs the same world size
    huggingface/            optional: config.json + safetensors, loadable by transformers
A save writes everything into `<path>.tmp/` and renames it to `<path>` only after every rank
finished, so a save killed midway never leaves a half-written `<path>` (the previous step's
folder stays the latest complete one).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from verl_moe.ops import device

logger = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"
CONTENTS = ("model", "optimizer", "extra", "hf_model")


def checkpoint_contents(checkpoint_config, which: str) -> tuple[str, ...]:
    """`save_contents` / `load_contents` of verl's CheckpointConfig (all but hf_model when None)."""
    if checkpoint_config is None:
        return ("model", "optimizer", "extra")
    contents = tuple(getattr(checkpoint_config, f"{which}_contents"))
    unknown = set(contents) - set(CONTENTS)
    if unknown:
        raise ValueError(f"{which}_contents has unknown entries {sorted(unknown)}; choices: {CONTENTS}")
    if "model" not in contents:
        raise ValueError(f"{which}_contents must include 'model'")
    return contents


@torch.no_grad()
def move_module(module: nn.Module, target: torch.device) -> None:
    """Sharded parameters and their gradients to `target` (FSDP2 re-points its shards on `.to`)."""
    module.to(target)
    for param in module.parameters():
        if param.grad is not None and param.grad.device != target:
            param.grad = param.grad.to(target)


@torch.no_grad()
def move_optimizer_state(optimizer: torch.optim.Optimizer, target: torch.device) -> None:
    """Optimizer state tensors to `target`; Adam's scalar `step` stays on the CPU where it lives."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(target)


def exported_state(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor as held: DTensor or plain) per state-dict entry that leaves the trainer; a tied
    lm_head is left out, as transformers does on save."""
    tied = model.arch.tie_word_embeddings
    for name, tensor in model.state_dict().items():
        if not (tied and name == "lm_head.weight"):
            yield name, tensor


def full_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) per `exported_state` entry, all-gathered one at a time (every rank must iterate)."""
    for name, tensor in exported_state(model):
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if device.is_accelerator():
        state["device"] = device.device_module().get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if device.is_accelerator():
        device.device_module().set_rng_state(state["device"])


def _export_hf(model: nn.Module, path: str) -> None:
    """Gather full tensors; rank 0 loads them into an unsharded copy of the spec and writes HF files."""
    from verl_moe.models import build, save_pretrained

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        dtype = next(iter(full.values())).dtype
        copy = build(model.config, dtype=dtype, device="meta")
        copy.to_empty(device="cpu")
        copy.load_state_dict(full, strict=not model.arch.tie_word_embeddings)
        if model.arch.tie_word_embeddings:
            copy.lm_head.weight = copy.model.embed_tokens.weight
        save_pretrained(copy, path)


def save(path: str, *, model: nn.Module, optimizer, lr_scheduler, global_step: int, hf_export: bool) -> None:
    """Write a checkpoint folder (see module docstring) atomically: `<path>.tmp`, then rename."""
    path = os.path.abspath(path)
    tmp = path + TMP_SUFFIX
    rank = dist.get_rank()
    if rank == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)  # left behind by an interrupted save
    dist.barrier()
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
    dcp.save(state, checkpoint_id=os.path.join(tmp, "dcp"))
    extra = {"global_step": global_step, "rng": _rng_state(), "world_size": dist.get_world_size()}
    if lr_scheduler is not None:
        extra["lr_scheduler"] = lr_scheduler.state_dict()
    torch.save(extra, os.path.join(tmp, f"extra_rank{rank}.pt"))
    if hf_export:
        _export_hf(model, os.path.join(tmp, "huggingface"))
    dist.barrier()
    if rank == 0:
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    dist.barrier()


def load(path: str, *, model: nn.Module, optimizer, lr_scheduler) -> None:
    """Restore model (and optimizer / LR scheduler / RNG when given) from `save`'s folder.

    Raises FileNotFoundError for a missing or incomplete folder, ValueError for a world-size change
    with per-rank state requested.
    """
    path = os.path.abspath(path)
    if not os.path.isdir(os.path.join(path, "dcp")):
        raise FileNotFoundError(
            f"no complete checkpoint at {path} (an interrupted save leaves only {path}{TMP_SUFFIX})"
        )
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
        set_model_state_dict(model, state["model"])
    else:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if lr_scheduler is None:
        return
    extra_file = os.path.join(path, f"extra_rank{dist.get_rank()}.pt")
    if not os.path.isfile(extra_file):
        raise ValueError(f"{extra_file} missing: the checkpoint was saved with a different world size")
    extra = torch.load(extra_file, weights_only=False)
    lr_scheduler.load_state_dict(extra["lr_scheduler"])
    _set_rng_state(extra["rng"])


def prune(paths: list[str], keep: int) -> list[str]:
    """Delete all but the newest `keep` checkpoint folders (rank 0); returns the kept paths."""
    if keep <= 0:
        return paths
    if dist.get_rank() == 0:
        for old in paths[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return paths[-keep:]
