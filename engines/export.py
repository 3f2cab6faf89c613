"""Weights out of a sharded model, in the names their readers expect: full tensors (HF names, or
vLLM's with experts split per expert, for verl's rollout), this rank's shards (for verl's sharded
delta sync) and the delta since the last export, in vLLM's names and coordinates.

Every function takes the spec (`MoeCausalLM`, FSDP-sharded or not); the engine keeps the parameters
on its compute device while a generator runs (`MoeEngineBase._params_on_device`). A tied lm_head is
left out everywhere, as transformers does on save. LoRA adapters (`models/lora.py`) are never among
the base names: `merge_lora` exports base + scale * B A under them, `adapter_named_tensors` the
adapters under peft's names (verl's FSDP engine's two forms).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from verl_moe.models import lora
from verl_moe.models.weights import to_vllm_named_tensors, vllm_slot_positions, vllm_slots

LAYOUTS = ("vllm", "hf")


def exported_state(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor as held: DTensor or plain) per state-dict entry that leaves the trainer; a tied
    lm_head is left out, as transformers does on save, and so are LoRA adapters (base names only)."""
    tied = model.arch.tie_word_embeddings
    for name, tensor in model.state_dict().items():
        if not (tied and name == "lm_head.weight") and not lora.is_adapter_key(name):
            yield name, tensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def full_named_tensors(model: nn.Module, merge_lora: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) per `exported_state` entry, all-gathered one at a time (every rank must iterate).
    merge_lora: a LoRA-adapted weight comes out as base + scale * B A (its factors gathered with it)."""
    adapted = lora.adapted_weights(model) if merge_lora else {}
    state = model.state_dict() if adapted else {}
    for name, tensor in exported_state(model):
        full = _full(tensor)
        if name in adapted:
            a, b, scale = adapted[name]
            full = lora.merge_weight(full, _full(state[a]), _full(state[b]), scale)
        yield name, full


def adapter_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(peft name, full tensor) per LoRA adapter entry (`lora.peft_name`), all-gathered one at a time."""
    for name, tensor in model.state_dict().items():
        if lora.is_adapter_key(name):
            yield lora.peft_name(name), _full(tensor)


def per_tensor_params(
    model: nn.Module, layout: str = "vllm", merge_lora: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) per exported entry; every rank must consume it (each tensor is all-gathered).
    layout "vllm": experts split per expert in vLLM's names; "hf": transformers names, fused experts.
    merge_lora: LoRA-adapted weights merged (`full_named_tensors`); else the base weights alone.
    Raises ValueError for another layout (before anything is gathered)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'vllm' or 'hf', got {layout!r}")
    named = full_named_tensors(model, merge_lora)
    return to_vllm_named_tensors(named) if layout == "vllm" else named


def local_shards(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, object]]:
    """(transformers name, this rank's local shard flat in bf16, verl `ShardSpec`) per exported entry:
    no collective, the same names in the same order on every rank; bf16 is what the rollout holds, so
    an update that rounds away is not shipped."""
    from verl.workers.engine.spec import ShardSpec

    for name, tensor in exported_state(model):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.is_floating_point():
            local = local.to(torch.bfloat16)
        yield name, local.reshape(-1), ShardSpec.from_param(tensor)


def vllm_delta_entry(name: str, spec, place, local_idx: torch.Tensor, values: torch.Tensor) -> tuple:
    """verl's per-parameter delta entry `(slots, dtype, counts, positions, values)` in vLLM's names:
    this rank's changed elements (shard-local flat `local_idx`) moved to the full tensor, then to the
    `vllm_slots` it splits into (a fused expert tensor: one slot per expert projection), slot-major.
    Every slot is listed on every rank, with zero counts where untouched, so the ranks' gathers stay in step."""
    from verl.workers.engine.spec import translate_flat_indices

    slots = vllm_slots(name, tuple(spec.full_shape))
    full_idx = translate_flat_indices(local_idx, place) if local_idx.numel() else local_idx
    slot, position = vllm_slot_positions(slots, full_idx)
    order = torch.argsort(slot, stable=True)
    counts = torch.bincount(slot, minlength=len(slots)).to(device="cpu", dtype=torch.int64)
    dtype = str(values.dtype).removeprefix("torch.")
    return slots, dtype, counts, position[order].to(torch.int32), values[order]


def delta_entries(shards: Iterator, snapshots: dict[str, torch.Tensor]) -> Iterator[tuple]:
    """verl's delta export over `local_shards`: per parameter, the elements changed since `snapshots`
    (which it refreshes) as `vllm_delta_entry`s. `snapshots` must hold every shard (verl's
    `prime_delta_snapshots` fills it after the seed sync)."""
    from verl.workers.engine.utils import hf_delta_export

    return hf_delta_export(shards, snapshots, vllm_delta_entry)
