"""`build`: the model for an HF config, picked by its spec (`registry.py`): `MoeCausalLM` for the text
configs (`causal_lm.py`), `MoeVisionLM` for the vision-language `qwen3_5_moe` config
(`qwen3_5_moe/vl_model.py`). Its own module because the vision-language model builds on causal_lm."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from . import causal_lm
from .causal_lm import MoeCausalLM
from .ops_config import OpsConfig
from .qwen3_5_moe.vl_model import MoeVisionLM, build_vision_lm
from .registry import get_spec


def build(
    hf_config,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    ops: OpsConfig | Mapping | None = None,
    compute_dtype: torch.dtype | None = None,
    text_only: bool = False,
) -> MoeCausalLM | MoeVisionLM:
    """A freshly initialised model for an HF config.

    Args:
        hf_config: a transformers config of a supported model_type: `qwen3_5_moe_text`, `qwen3_moe`
            (a MoeCausalLM) or `qwen3_5_moe`, the vision-language config (a MoeVisionLM).
        dtype: parameter dtype. device: where parameters live ("meta" allocates nothing).
        ops: implementation choices: an OpsConfig, a mapping of its fields (a Hydra config's
            dict), or None for OpsConfig() (auto everywhere, fp32 router).
        compute_dtype: the layers' compute dtype when it is not dtype (mixed precision): "auto"
            ops are chosen for it. None: dtype.
        text_only: for a vision-language config, its text decoder alone (a MoeCausalLM that loads
            the checkpoint's `model.language_model.*` and skips `model.visual.*`): what the engines
            train until they feed images.
    Raises:
        ValueError: unsupported model_type, invalid or unsupported config, unknown op implementation
            or `ops` key.
        TypeError: `ops` is neither an OpsConfig, a mapping nor None.
    """
    spec = get_spec(hf_config.model_type)
    if spec.vision_arch is not None and text_only:
        hf_config = spec.text_config(hf_config)
    elif spec.vision_arch is not None:
        return build_vision_lm(hf_config, spec, dtype, device, ops, compute_dtype)
    return causal_lm.build(hf_config, dtype, device, ops, compute_dtype)
