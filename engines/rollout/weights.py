"""Weights arriving from the trainer, copied into the rollout's `MoeCausalLM`.

verl hands the rollout `engine.get_per_tensor_param()` (our engines' default layout "vllm": the
names of `verl_moe.models.to_vllm_named_tensors`, experts split per expert). Each tensor is
copied into place as it arrives (a per-expert tensor into its rows of the fused expert weight),
so nothing is buffered. transformers names with fused experts (layout "hf") and the
vision-language prefix `model.language_model.` are accepted too; tensors outside the text model
(`models.weights.skipped_prefixes`: the vision tower, and the MTP tensors for a model without MTP
layers) are skipped. A model with MTP layers receives them like any other weight (decoding does not
use them). The load is strict: an unknown name, a wrong shape or a tensor that never arrives raises
ValueError naming it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch

from ...models import MoeCausalLM
from ...models.weights import skipped_prefixes

logger = logging.getLogger(__name__)

_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _model_name(name: str, model: MoeCausalLM, skips: tuple[str, ...]) -> str | None:
    if name.startswith(skips):
        return None
    for old, new in model.spec.checkpoint_renames:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


@torch.no_grad()
def load_named_tensors(model: MoeCausalLM, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy every (name, tensor) into `model` (cast to its dtype and device); returns how many
    tensors were copied. Consumes the whole iterable.

    Raises:
        ValueError: an unknown name, a shape that does not fit, or parameters left without a tensor.
    """
    params = model.state_dict(keep_vars=True)
    tied = model.arch.tie_word_embeddings
    expected = {n for n in params if not (tied and n == "lm_head.weight")}
    filled: set[str] = set()
    expert_parts: dict[str, set[tuple[int, str]]] = {}  # fused name -> (expert, proj) received
    copied = skipped = 0
    skips = skipped_prefixes(model)
    for raw_name, tensor in named_tensors:
        name = _model_name(raw_name, model, skips)
        if name is None or (tied and name == "lm_head.weight"):
            skipped += 1
            continue
        m = _PER_EXPERT.match(name)
        if m is None:
            if name not in expected:
                raise ValueError(f"rollout weight {raw_name!r} is not a parameter of the {model.spec.family} model")
            _copy(params[name], tensor, raw_name)
            filled.add(name)
        else:
            e, proj, prefix = int(m["e"]), m["proj"], m["prefix"]
            fused = f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
            if fused not in expected or e >= params[fused].shape[0]:
                raise ValueError(f"rollout weight {raw_name!r} is not an expert of the {model.spec.family} model")
            target = params[fused][e]
            if proj != "down_proj":
                rows = target.shape[0] // 2
                target = target[:rows] if proj == "gate_proj" else target[rows:]
            _copy(target, tensor, raw_name)
            expert_parts.setdefault(fused, set()).add((e, proj))
        copied += 1
    for fused, parts in expert_parts.items():
        want = params[fused].shape[0] * (1 if fused.endswith("down_proj") else 2)
        if len(parts) == want:
            filled.add(fused)
    missing = sorted(expected - filled)
    if missing:
        raise ValueError(
            f"rollout weights incomplete: {len(missing)} parameter(s) got no (or not every expert's) tensor, "
            f"e.g. {missing[:4]}"
        )
    if skipped:
        logger.info("verl_moe rollout: skipped %d tensors outside the text model or tied", skipped)
    return copied


def _copy(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(f"rollout weight {name!r}: shape {tuple(tensor.shape)}, model expects {tuple(target.shape)}")
    target.copy_(tensor)


__all__ = ["load_named_tensors"]
