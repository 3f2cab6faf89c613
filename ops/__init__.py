"""Portable ops for Qwen3.5-MoE / Qwen3-MoE: a PyTorch reference beside each Triton kernel.

`resolve(op, impl)` picks the implementation (see `dispatch.py`); the public functions below
are the reference-or-kernel entry points the models and engines call.
"""

from .dispatch import resolve
from .logprob import logprobs_and_entropy

__all__ = ["logprobs_and_entropy", "resolve"]
