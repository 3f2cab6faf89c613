"""Qwen3.5-MoE: config reading, the GatedDeltaNet layer, the vision tower and mRoPE position ids;
the rest of the text decoder is shared. The vision-language model is `vl_model.MoeVisionLM`
(imported from `verl_moe.models`: it builds on `causal_lm`, which imports this package)."""

from .config import arch_config, text_config, vision_arch
from .gated_deltanet import GatedDeltaNet
from .rope_index import mrope_position_ids
from .vision import VisionArch, VisionModel

__all__ = [
    "GatedDeltaNet",
    "VisionArch",
    "VisionModel",
    "arch_config",
    "mrope_position_ids",
    "text_config",
    "vision_arch",
]
