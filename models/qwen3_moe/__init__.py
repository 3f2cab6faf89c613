"""Qwen3-MoE: config reading; every module is the shared decoder of `verl_moe.models`."""

from .config import arch_config, text_config

__all__ = ["arch_config", "text_config"]
