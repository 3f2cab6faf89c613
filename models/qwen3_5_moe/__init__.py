"""Qwen3.5-MoE (text part): config reading and the GatedDeltaNet layer; the rest is shared."""

from .config import arch_config, text_config
from .model import GatedDeltaNet

__all__ = ["GatedDeltaNet", "arch_config", "text_config"]
