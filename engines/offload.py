"""Offload for our FSDP2 engines (verl's `engine.to` / param and optimizer offload): sharded
parameters, their gradients and optimizer state moved between the host and the accelerator."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def move_module(module: nn.Module, target: torch.device) -> None:
    """Sharded parameters and their gradients to `target` (FSDP2 re-points its shards on `.to`)."""
    module.to(target)
    for param in module.parameters():
        if param.grad is not None and param.grad.device != target:
            param.grad = param.grad.to(target)


@torch.no_grad()
def move_optimizer_state(optimizer: torch.optim.Optimizer, target: torch.device) -> None:
    """Optimizer state tensors to `target`; Adam's scalar `step` stays on the CPU where it lives."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(target)
