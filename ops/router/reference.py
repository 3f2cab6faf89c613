"""Top-k softmax router and the load-balancing loss, in an explicit dtype.

transformers computes the router GEMM in the model dtype (bf16 in training) and only the
softmax in fp32; here the GEMM, softmax, top-k, renormalisation and the returned combine
weights are all in `dtype` (fp32 by default, fp64 for goldens, or the model dtype to mimic HF),
so expert choice does not flip with the precision of one GEMM.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def check_route_inputs(hidden, gate_weight, top_k: int, dtype: torch.dtype) -> None:
    """Raise ValueError for inputs no router takes (shapes, top_k range, dtypes)."""
    if hidden.dim() != 2 or gate_weight.dim() != 2 or hidden.shape[1] != gate_weight.shape[1]:
        raise ValueError(
            f"hidden must be [N, D] and gate_weight [E, D], got {tuple(hidden.shape)} and {tuple(gate_weight.shape)}"
        )
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"router dtype must be a floating torch.dtype, got {dtype!r}")
    if not hidden.is_floating_point() or not gate_weight.is_floating_point():
        raise ValueError(f"hidden and gate_weight must be floating point, got {hidden.dtype}, {gate_weight.dtype}")
    num_experts = gate_weight.shape[0]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, E={num_experts}], got {top_k}")


def route_ref(
    hidden: torch.Tensor,
    gate_weight: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax top-k routing (the dispatched `router` op).

    Args:
        hidden: [N, D] token activations, any float dtype.
        gate_weight: [E, D] router weight (transformers' `mlp.gate.weight`).
        top_k: experts per token, 1 <= TOPK <= E.
        norm_topk_prob: renormalise the TOPK probabilities to sum to 1 per token.
        dtype: compute dtype of every step (floating point).
    Returns:
        router_logits: [N, E] in dtype (pre-softmax).
        topk_weight: [N, TOPK] in dtype, the combine weights.
        topk_idx: [N, TOPK] int64 expert ids, by descending probability.
    Raises:
        ValueError: bad shapes, top_k out of range, non-float dtype.
    """
    check_route_inputs(hidden, gate_weight, top_k, dtype)
    return route_logits(F.linear(hidden.to(dtype), gate_weight.to(dtype)), top_k, norm_topk_prob)


def route_logits(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router after its GEMM: logits [N, E] -> (logits, topk_weight, topk_idx) as `route_ref`."""
    probs = torch.softmax(logits, dim=-1)
    topk_weight, topk_idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        topk_weight = topk_weight / topk_weight.sum(dim=-1, keepdim=True)
    return logits, topk_weight, topk_idx


def load_balancing_loss(
    router_logits: torch.Tensor | Sequence[torch.Tensor],
    top_k: int,
    num_experts: int,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Switch/GShard auxiliary load-balancing loss from raw router logits (one softmax).

    Per MoE layer: loss = E * sum_e f_e * P_e, with P_e the mean softmax probability of expert e
    and f_e the fraction of tokens that picked e among their TOPK (so sum_e f_e = TOPK, the
    convention of transformers' `load_balancing_loss_func`); the result is the mean over layers.
    transformers instead pools the tokens of all layers into one f and one P; for a single layer
    the two agree.

    Args:
        router_logits: [N, E] logits, or a sequence of them (one per MoE layer), any float dtype.
        top_k: experts per token.
        num_experts: E.
        token_mask: optional [N] bool/0-1 tensor; only tokens with mask 1 count (padding excluded).
    Returns:
        0-d tensor in fp32 (fp64 when the logits are fp64).
    Raises:
        ValueError: bad shapes, top_k out of range, mask of the wrong length or with no tokens.
    """
    layers = [router_logits] if isinstance(router_logits, torch.Tensor) else list(router_logits)
    if not layers:
        raise ValueError("load_balancing_loss needs at least one layer of router logits")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    losses = []
    for logits in layers:
        if logits.dim() != 2 or logits.shape[1] != num_experts:
            raise ValueError(f"router logits must be [N, E={num_experts}], got {tuple(logits.shape)}")
        cd = torch.float64 if logits.dtype == torch.float64 else torch.float32
        probs = torch.softmax(logits.to(cd), dim=-1)
        picked = F.one_hot(probs.topk(top_k, dim=-1).indices, num_experts).sum(1).to(cd)  # [N, E]
        if token_mask is None:
            weights = torch.full((logits.shape[0], 1), 1.0 / logits.shape[0], dtype=cd, device=logits.device)
        else:
            if token_mask.shape != (logits.shape[0],):
                raise ValueError(f"token_mask must be [N={logits.shape[0]}], got {tuple(token_mask.shape)}")
            mask = token_mask.to(cd)[:, None]
            if mask.sum() == 0:
                raise ValueError("token_mask selects no token")
            weights = mask / mask.sum()
        f = (picked * weights).sum(0)
        P = (probs * weights).sum(0)
        losses.append(num_experts * (f * P).sum())
    return torch.stack(losses).mean()
