"""Checkpoint I/O in the layouts real checkpoints use, and names for vLLM weight sync.

On disk (local HF folder: config.json + *.safetensors, one file or sharded with an index):
- experts per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, as Qwen3-MoE / Qwen3.5-MoE
  checkpoints store them and transformers 5.10 saves both) or fused (`mlp.experts.gate_up_proj`
  [E, 2I, D], `mlp.experts.down_proj` [E, D, I], the in-memory layout). Per-expert tensors are
  merged like transformers' conversion mapping: gate_up_proj[e] = cat(gate_proj[e], up_proj[e])
  along rows.
- Qwen3.5 vision-language checkpoints (`model.visual.*`, `model.language_model.*`, `lm_head`) load
  into the vision-language model (`MoeVisionLM`) under their own names and save in that layout. A
  text-only config's model renames a `model.language_model.` prefix to `model.` and skips `model.visual.*`.
- Qwen3.5's multi-token-prediction tensors (`mtp.*`) load into the model's MTP module, strictly, when the
  config has MTP layers (`mtp_num_hidden_layers`), and are saved and exported under the same names;
  with none they are skipped (one log line), as transformers skips them.
Loading is strict: a missing, unexpected, mis-shaped or twice-stored tensor, or an unreadable
file, raises ValueError naming it. Files are picked as transformers picks them in a local folder:
`model.safetensors` when present, else `model.safetensors.index.json` and the shards it names.
A save first removes the folder's earlier weight files, so a re-save never leaves stale shards.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from .causal_lm import MoeCausalLM
from .factory import build
from .ops_config import OpsConfig
from .qwen3_5_moe.vl_model import MoeVisionLM
from .registry import ModelSpec, get_spec

logger = logging.getLogger(__name__)

_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_VL_PREFIXES = ("model.language_model.", "model.visual.")
_FUSED = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Every weight file a transformers (or our) save may have left: removed before our save writes its own.
STALE_WEIGHT_PATTERNS = ("*.safetensors", INDEX_FILE, "pytorch_model*.bin", "pytorch_model.bin.index.json")


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a local HF folder, chosen as transformers chooses them: the single
    `model.safetensors` when it exists (an index beside it is ignored), else the shards that
    `model.safetensors.index.json` names.

    Raises:
        FileNotFoundError: `path` is not a folder, holds neither file, or its index names a missing shard.
        ValueError: the index is not valid JSON with a `weight_map`.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"model folder {root} does not exist")
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    index = root / INDEX_FILE
    if not index.is_file():
        torch_files = sorted(p.name for p in root.glob("pytorch_model*.bin"))
        found = f" (found {torch_files}: only safetensors are read)" if torch_files else ""
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {root}{found}")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index}: not a safetensors index with a weight_map ({e!r})") from None
    files = [root / name for name in names]
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{file.name}, named in {index}, does not exist")
    return files


def skipped_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Checkpoint key prefixes that are not part of `model` (a MoeCausalLM or MoeVisionLM): its spec's
    skips, and the MTP tensors when the config has no MTP layers."""
    spec = model.spec
    no_mtp = spec.mtp_prefix is not None and not model.arch.mtp_num_hidden_layers
    return spec.checkpoint_skips + ((spec.mtp_prefix,) if no_mtp else ())


def _normalise_key(key: str, spec: ModelSpec, skips: tuple[str, ...]) -> str | None:
    """The model's name for a checkpoint key, or None for a tensor outside the model."""
    if key.startswith(skips):
        return None
    for old, new in spec.checkpoint_renames:
        if key.startswith(old):
            return new + key[len(old) :]
    return key


def load_checkpoint(model: MoeCausalLM | MoeVisionLM, path: str | os.PathLike) -> None:
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
        if name in loaded:  # fused and per-expert copies of one layer's experts
            raise ValueError(f"{name} is stored twice in checkpoint {path} (fused and per expert)")
        param = params[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(name)

    origin: dict[str, tuple[str, Path]] = {}  # model name -> (checkpoint key, file) it was read from
    skips = skipped_prefixes(model)
    for file, key, read in _checkpoint_tensors(path):
        name = _normalise_key(key, model.spec, skips)
        if name is None:
            skipped.append(key)
            continue
        if name in origin:
            first_key, first_file = origin[name]
            raise ValueError(f"{name} is stored twice: as {first_key} in {first_file} and as {key} in {file}")
        origin[name] = (key, file)
        if tied and name == "lm_head.weight":
            # A tied lm_head is embed_tokens; some checkpoints store the copy anyway.
            skipped.append(key)
            continue
        m = _PER_EXPERT.match(name)
        if m is None:
            copy_into(name, read())
            continue
        tensor = read()
        want = _per_expert_shape(params, m["prefix"], m["proj"])
        if want is not None and tuple(tensor.shape) != want:
            raise ValueError(f"{key} in {file}: shape {tuple(tensor.shape)}, expected {want}")
        per_proj = pending.setdefault(m["prefix"], {"gate_proj": {}, "up_proj": {}, "down_proj": {}})
        per_proj[m["proj"]][int(m["e"])] = tensor
        # Merge a layer as soon as it is complete, so at most one layer of experts waits in memory.
        if all(len(per_proj[p]) == num_experts for p in per_proj):
            _merge_experts(m["prefix"], pending.pop(m["prefix"]), num_experts, copy_into)
    if pending:
        counts = {prefix: {p: len(v) for p, v in projs.items()} for prefix, projs in pending.items()}
        raise ValueError(f"incomplete per-expert tensors (expected {num_experts} of each): {counts}")
    if skipped:
        logger.info(
            "verl_moe: skipped %d checkpoint tensors outside the model or tied (%s)",
            len(skipped),
            ", ".join(sorted({k.split(".")[0] + "." + k.split(".")[1] for k in skipped})),
        )
    missing = sorted(expected - loaded)
    if missing or unexpected:
        hint = ""
        if model.spec.mtp_prefix and all(name.startswith(model.spec.mtp_prefix) for name in missing):
            hint = (
                f"; the config has mtp_num_hidden_layers={model.arch.mtp_num_hidden_layers} (a checkpoint saved "
                "without its MTP tensors, as transformers saves, loads with mtp_num_hidden_layers=0)"
            )
        raise ValueError(
            f"checkpoint {path} does not match the model: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''} ({len(missing)}), unexpected {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)}){hint if missing else ''}"
        )


def _checkpoint_tensors(path) -> Iterator[tuple[Path, str, Callable[[], torch.Tensor]]]:
    """(file, key, read) for every tensor of the folder's checkpoint files; `read()` loads it on the
    CPU. A file safetensors cannot parse (truncated, damaged) raises ValueError naming it."""
    for file in checkpoint_files(path):
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except SafetensorError as e:
            raise ValueError(f"{file}: unreadable safetensors file, truncated or damaged? ({e})") from None
        with handle as f:
            for key in f.keys():

                def read(key=key, f=f, file=file) -> torch.Tensor:
                    try:
                        return f.get_tensor(key)
                    except SafetensorError as e:
                        raise ValueError(f"{file}: cannot read tensor {key} ({e})") from None

                yield file, key, read


def _per_expert_shape(params: dict, prefix: str, proj: str) -> tuple[int, int] | None:
    """The [rows, cols] one expert's `proj` must have, from the model's fused tensor (None when the
    model has no such layer: the name is then reported as unexpected)."""
    if proj == "down_proj":
        fused = params.get(f"{prefix}.down_proj")  # [E, D, I]
        return None if fused is None else tuple(fused.shape[1:])
    fused = params.get(f"{prefix}.gate_up_proj")  # [E, 2I, D]
    return None if fused is None else (fused.shape[1] // 2, fused.shape[2])


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
    ops: OpsConfig | Mapping | None = None,
    compute_dtype: torch.dtype | None = None,
    text_only: bool = False,
    config=None,
) -> MoeCausalLM | MoeVisionLM:
    """Build the model of a local HF folder and load its weights (strict; see module docstring).
    Parameters are allocated once on `device` (no random init of what the checkpoint overwrites).
    compute_dtype, text_only: as in `verl_moe.models.build`. config: the HF config to build instead of
    the folder's config.json (verl's model config, which zeroes the MTP layers unless `model.mtp.enable`).

    Raises:
        FileNotFoundError: `path` is not a folder, or lacks config.json or weight files.
        ValueError: see `load_checkpoint`; an unsupported config or op choice (see `build`).
    """
    from transformers import AutoConfig

    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"model folder {root} does not exist")
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in model folder {root}")
    hf_config = AutoConfig.from_pretrained(str(root)) if config is None else config
    model = build(hf_config, dtype=dtype, device="meta", ops=ops, compute_dtype=compute_dtype, text_only=text_only)
    checkpoint_files(root)  # a folder without weights fails before any allocation
    model.to_empty(device=torch.device(device))
    if isinstance(model, MoeVisionLM):
        model.tie_weights()
    elif model.arch.tie_word_embeddings:
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


def save_pretrained(
    model: MoeCausalLM | MoeVisionLM, path: str | os.PathLike, max_shard_bytes: int = 5 * 1024**3
) -> None:
    """Write config.json (the model's config, dtype set to the model's: the text config for a
    MoeCausalLM, the vision-language config for a MoeVisionLM) and safetensors (sharded with an
    index above `max_shard_bytes`) that transformers' `from_pretrained` loads into an identical model.
    Experts are written per expert (the layout of real checkpoints and of transformers' own save);
    a tied lm_head is not written. Weight files already in the folder (safetensors, their index,
    pytorch_model*.bin) are removed first: left beside the new ones they could be loaded instead."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    for pattern in STALE_WEIGHT_PATTERNS:
        for stale in root.glob(pattern):
            stale.unlink()
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
        model_or_named_tensors: a MoeCausalLM or MoeVisionLM, or an iterable of (transformers name, tensor).
        language_model_prefix: rename `model.` to `model.language_model.` (the checkpoint names of
            the vision-language Qwen3.5-MoE, for a vLLM engine serving that class); names that are
            already vision-language ones (`model.language_model.*`, `model.visual.*`) stay.
    """
    if isinstance(model_or_named_tensors, nn.Module):
        model = model_or_named_tensors
        tied = isinstance(model, MoeCausalLM | MoeVisionLM) and model.arch.tie_word_embeddings
        pairs = ((n, t) for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight"))
    else:
        pairs = iter(model_or_named_tensors)
    for name, tensor in pairs:
        for key, t in _split_experts(name, tensor):
            if language_model_prefix and key.startswith("model.") and not key.startswith(_VL_PREFIXES):
                key = "model.language_model." + key[len("model.") :]
            yield key, t


__all__ = [
    "checkpoint_files",
    "skipped_prefixes",
    "from_pretrained",
    "get_spec",
    "load_checkpoint",
    "save_pretrained",
    "to_vllm_named_tensors",
    "vllm_slot_positions",
    "vllm_slots",
]
