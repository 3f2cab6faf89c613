"""Portable ops for Qwen3.5-MoE / Qwen3-MoE: a PyTorch reference beside each Triton kernel.

One folder per op (`ops/<op>/`: `reference.py` beside the kernels, `IMPLS` in `__init__.py`).
`resolve(op, impl)` picks the implementation (see `dispatch.py`); the functions below are the
public entry points. Importing this package does not import Triton.
"""

from .attention import causal_attention
from .conv1d import causal_conv1d
from .dispatch import resolve
from .experts import moe_experts
from .gdn import chunk_gated_delta_rule, recurrent_gated_delta_rule_ref
from .logprob import logprobs_and_entropy
from .norm import gated_rms_norm, rms_norm
from .rope import apply_rotary_pos_emb, rope_cos_sin, rope_inv_freq
from .router import load_balancing_loss, route

__all__ = [
    "apply_rotary_pos_emb",
    "causal_attention",
    "causal_conv1d",
    "chunk_gated_delta_rule",
    "gated_rms_norm",
    "load_balancing_loss",
    "logprobs_and_entropy",
    "moe_experts",
    "recurrent_gated_delta_rule_ref",
    "resolve",
    "rms_norm",
    "rope_cos_sin",
    "rope_inv_freq",
    "route",
]
