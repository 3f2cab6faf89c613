"""`build`: the model for any supported HF config, picked by its spec (`registry.py`): `build_causal_lm`
(`causal_lm.py`) for the text configs, `build_vision_lm` (`qwen3_5_moe/vl_model.py`) for the
vision-language `qwen3_5_moe` config. Its own module because the vision-language model builds on causal_lm."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .causal_lm import MoeCausalLM, build_causal_lm
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
    return build_causal_lm(hf_config, dtype, device, ops, compute_dtype)
