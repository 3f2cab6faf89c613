"""The plain projection: torch's own GEMM (its blocking, and so its rounding, may depend on the row count)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K], bias [N] or None -> [..., N] in x's dtype (`F.linear`)."""
    return F.linear(x, weight, bias)


__all__ = ["linear_ref"]
