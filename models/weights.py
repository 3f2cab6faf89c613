"""Checkpoint I/O in the layouts real checkpoints use, and names for vLLM weight sync.

On disk (local HF folder: config.json + *.safetensors, one file or sharded with an index):
- experts per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, as Qwen3-MoE / Qwen3.5-MoE
  checkpoints store them and transformers 5.10 saves both) or fused (`mlp.experts.gate_up_proj`
  [E, 2I, D], `mlp.experts.down_proj` [E, D, I], the in-memory layout). Per-expert tensors are
  merged like transformers' conversion mapping: gate_up_proj[e] = cat(gate_proj[e], up_proj[e])
  along rows.
- Qwen3.5 vision-language checkpoints prefix the text model with `model.language_model.`; it is
  renamed to `model.`, and `model.visual.*` / `mtp.*` tensors are skipped (one log line).
Loading is strict: a missing, unexpected or mis-shaped tensor raises ValueError.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .causal_lm import MoeCausalLM, build
from .ops_config import OpsConfig
from .registry import ModelSpec, get_spec

logger = logging.getLogger(__name__)

_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a local HF folder (from the index when there is one)."""
    root = Path(path)
    if (root / INDEX_FILE).is_file():
        weight_map = json.loads((root / INDEX_FILE).read_text())["weight_map"]
        return [root / name for name in sorted(set(weight_map.values()))]
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors under {root}")
    return files


def _normalise_key(key: str, spec: ModelSpec) -> str | None:
    """The model's name for a checkpoint key, or None for a tensor outside the text model."""
    if key.startswith(spec.checkpoint_skips):
        return None
    for old, new in spec.checkpoint_renames:
        if key.startswith(old):
            return new + key[len(old) :]
    return key


def load_checkpoint(model: MoeCausalLM, path: str | os.PathLike) -> None:
    """Copy every tensor of the HF folder `path` into `model` (cast to its dtype and device), strictly.

    Raises:
        ValueError: missing / unexpected / mis-shaped tensors, or an incomplete set of experts.
    """
    params = model.state_dict(keep_vars=True)
    tied = model.arch.tie_word_embeddings
    expected = {name for name in params if not (tied and name == "lm_head.weight")}
    loaded, unexpected, skipped = set(), [], []
    pending: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    num_experts = model.arch.num_experts

    def copy_into(name: str, tensor: torch.Tensor) -> None:
        if name not in expected:
            unexpected.append(name)
            return
        param = params[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(name)

    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = _normalise_key(key, model.spec)
                if name is None or (tied and name == "lm_head.weight"):
                    # A tied lm_head is embed_tokens; some checkpoints store the copy anyway.
                    skipped.append(key)
                    continue
                m = _PER_EXPERT.match(name)
                if m is None:
                    copy_into(name, f.get_tensor(key))
                    continue
                per_proj = pending.setdefault(m["prefix"], {"gate_proj": {}, "up_proj": {}, "down_proj": {}})
                per_proj[m["proj"]][int(m["e"])] = f.get_tensor(key)
                # Merge a layer as soon as it is complete, so at most one layer of experts waits in memory.
                if all(len(per_proj[p]) == num_experts for p in per_proj):
                    _merge_experts(m["prefix"], pending.pop(m["prefix"]), num_experts, copy_into)
    if pending:
        counts = {prefix: {p: len(v) for p, v in projs.items()} for prefix, projs in pending.items()}
        raise ValueError(f"incomplete per-expert tensors (expected {num_experts} of each): {counts}")
    if skipped:
        logger.info(
            "verl_moe: skipped %d checkpoint tensors outside the text model or tied (%s)",
            len(skipped),
            ", ".join(sorted({k.split(".")[0] + "." + k.split(".")[1] for k in skipped})),
        )
    missing = sorted(expected - loaded)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match the model: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''} ({len(missing)}), unexpected {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)})"
        )


def _merge_experts(prefix: str, projs: dict[str, dict[int, torch.Tensor]], num_experts: int, copy_into) -> None:
    if any(sorted(projs[p]) != list(range(num_experts)) for p in projs):
        raise ValueError(f"{prefix}: expert ids must be 0..{num_experts - 1}")
    gate = torch.stack([projs["gate_proj"][e] for e in range(num_experts)])  # [E, I, D]
    up = torch.stack([projs["up_proj"][e] for e in range(num_experts)])  # [E, I, D]
    copy_into(f"{prefix}.gate_up_proj", torch.cat([gate, up], dim=1))
    copy_into(f"{prefix}.down_proj", torch.stack([projs["down_proj"][e] for e in range(num_experts)]))


def from_pretrained(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    ops: OpsConfig | None = None,
) -> MoeCausalLM:
    """Build the model of a local HF folder and load its weights (strict; see module docstring).
    Parameters are allocated once on `device` (no random init of what the checkpoint overwrites)."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(str(path))
    model = build(hf_config, dtype=dtype, device="meta", ops=ops)
    model.to_empty(device=torch.device(device))
    if model.arch.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    load_checkpoint(model, path)
    return model


def vllm_slots(name: str, shape: tuple) -> list[tuple[str, tuple]]:
    """The (vLLM name, shape) tensors that the transformers tensor `name` of `shape` becomes, in its
    flat order, all of one size: per expert `gate_proj` [I, D] then `up_proj` [I, D] for a fused
    `gate_up_proj` [E, 2I, D]; per expert `down_proj` [D, I] for a fused `down_proj` [E, D, I]; the
    tensor itself for every other name. Flat position p of the tensor is position p % n of slot
    p // n, n being a slot's size (`vllm_slot_positions`)."""
    m = _FUSED.match(name)
    if m is None:
        return [(name, tuple(shape))]
    prefix, (experts, rows, cols) = m["prefix"], shape
    if m["proj"] == "down_proj":
        return [(f"{prefix}.{e}.down_proj.weight", (rows, cols)) for e in range(experts)]
    half = (rows // 2, cols)
    return [(f"{prefix}.{e}.{proj}.weight", half) for e in range(experts) for proj in ("gate_proj", "up_proj")]


def vllm_slot_positions(slots: list[tuple[str, tuple]], flat_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot, flat position inside the slot) of flat positions `flat_idx` of a tensor split into `slots`."""
    numel = math.prod(slots[0][1])
    return torch.div(flat_idx, numel, rounding_mode="floor"), flat_idx % numel


def _split_experts(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Per-expert (name, tensor) views of a fused expert tensor; other names pass through."""
    slots = vllm_slots(name, tuple(tensor.shape))
    if slots[0][0] == name:
        yield name, tensor
        return
    per_slot = tensor.reshape(len(slots), *slots[0][1])
    for s, (slot_name, _) in enumerate(slots):
        yield slot_name, per_slot[s]


def save_pretrained(model: MoeCausalLM, path: str | os.PathLike, max_shard_bytes: int = 5 * 1024**3) -> None:
    """Write config.json (the text config, dtype set to the model's; a model built from a vision-language
    config is saved as its text part, model_type `qwen3_5_moe_text`) and safetensors (sharded with an
    index above `max_shard_bytes`) that transformers' `from_pretrained` loads into an identical model.
    Experts are written per expert (the layout of real checkpoints and of transformers' own save);
    a tied lm_head is not written."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(model.config)
    config.dtype = next(model.parameters()).dtype
    # verl's HFModelConfig (and transformers' AutoModel) pick the class from `architectures`.
    config.architectures = [model.spec.hf_causal_lm]
    config.save_pretrained(str(root))
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if model.arch.tie_word_embeddings and name == "lm_head.weight":
            continue
        for key, t in _split_experts(name, tensor):
            # clone: safetensors refuses tensors that share storage (expert slices, views).
            tensors[key] = t.detach().to("cpu").clone()
    shards, current, size = [], {}, 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = t
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], str(root / SINGLE_FILE), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(root / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (root / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def to_vllm_named_tensors(
    model_or_named_tensors: nn.Module | Iterable[tuple[str, torch.Tensor]], language_model_prefix: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs in the names vLLM's Qwen3.5-MoE / Qwen3-MoE `load_weights` accept, for
    rollout weight sync.

    Fused experts are split into views `model.layers.{i}.mlp.experts.{e}.gate_proj.weight` [I, D],
    `...up_proj.weight` [I, D], `...down_proj.weight` [D, I] (no copies); every other name is the
    transformers name. Given a model, its state_dict is used and a tied lm_head is left out (vLLM
    ties it itself); given pairs (e.g. full tensors gathered from a sharded model) all pass.

    Args:
        model_or_named_tensors: a MoeCausalLM, or an iterable of (transformers name, tensor).
        language_model_prefix: rename `model.` to `model.language_model.` (the checkpoint names of
            the vision-language Qwen3.5-MoE, for a vLLM engine serving that class).
    """
    if isinstance(model_or_named_tensors, nn.Module):
        model = model_or_named_tensors
        tied = isinstance(model, MoeCausalLM) and model.arch.tie_word_embeddings
        pairs = ((n, t) for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight"))
    else:
        pairs = iter(model_or_named_tensors)
    for name, tensor in pairs:
        for key, t in _split_experts(name, tensor):
            if language_model_prefix and key.startswith("model."):
                key = "model.language_model." + key[len("model.") :]
            yield key, t


__all__ = [
    "checkpoint_files",
    "from_pretrained",
    "get_spec",
    "load_checkpoint",
    "save_pretrained",
    "to_vllm_named_tensors",
    "vllm_slot_positions",
    "vllm_slots",
]
