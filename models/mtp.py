"""Multi-token prediction (MTP): what the shift means, as plain tensor functions.

Qwen3.5 checkpoints carry an MTP module (`mtp.*`; the module is `causal_lm.MultiTokenPredictor`). Its
depth k (1..n) reads, at position t, the hidden state of depth k-1 at t (the main model's final hidden
state for k = 1) and the embedding of token t+k, and the shared lm_head turns its output into a
prediction of token t+k+1. Megatron's auxiliary loss (`mtp_loss_scaling_factor`) is the cross-entropy of
those predictions, averaged over the valid positions of each depth, scaled by factor / n and added to the
main loss. A position is valid at depth k when token t+k+1 lies in t's own sequence and is a training
target (verl's `loss_mask` is 1 on it), so in a packed row nothing is read across a sequence boundary.

Alphabet: B rows, T tokens per row, N sequences, n MTP depths.
"""

from __future__ import annotations

import torch


def sequence_ends(num_tokens: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """[T] int64: for each position, the end (exclusive) of its sequence in the row: cu_seqlens' next
    offset for a packed row, T for a row that is one sequence (cu_seqlens None)."""
    if cu_seqlens is None:
        return torch.full((num_tokens,), num_tokens, dtype=torch.int64, device=device)
    bounds = cu_seqlens.to(device=device, dtype=torch.int64)
    positions = torch.arange(num_tokens, device=device)
    return bounds[1:][torch.searchsorted(bounds[1:], positions, right=True)]


def shift_left(
    values: torch.Tensor, k: int, cu_seqlens: torch.Tensor | None = None, fill: int | float = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values[:, t + k] where t + k lies in t's sequence else `fill`, that validity [B, T] bool).

    values: [B, T] (a packed row: B == 1 with cu_seqlens [N+1]; without cu_seqlens each row is one
    sequence). k >= 0."""
    if k < 0:
        raise ValueError(f"shift_left shifts left by k >= 0, got {k}")
    B, T = values.shape
    source = torch.arange(T, device=values.device) + k
    valid = source < sequence_ends(T, cu_seqlens, values.device)
    shifted = values[:, source.clamp(max=T - 1)]
    return torch.where(valid, shifted, torch.full_like(shifted, fill)), valid.expand(B, T)


def mtp_targets(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, depth: int, cu_seqlens: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """What each MTP depth predicts: (labels [n, B, T] int64: token t+k+1 at depth k, 0 where it is not
    in t's sequence; mask [n, B, T] bool: the position is valid, i.e. token t+k+1 is in t's sequence and
    `loss_mask` [B, T] (verl's: 1 on the tokens that are training targets) is set on it)."""
    if depth < 1:
        raise ValueError(f"MTP depth must be >= 1, got {depth}")
    if loss_mask.shape != input_ids.shape:
        raise ValueError(f"loss_mask {tuple(loss_mask.shape)} must have input_ids' shape {tuple(input_ids.shape)}")
    labels, masks = [], []
    for k in range(1, depth + 1):
        label, _ = shift_left(input_ids, k + 1, cu_seqlens)
        target, valid = shift_left(loss_mask.to(torch.bool), k + 1, cu_seqlens, fill=False)
        labels.append(label.to(torch.int64))
        masks.append(target & valid)
    return torch.stack(labels), torch.stack(masks)


def mtp_valid_counts(loss_mask: torch.Tensor, offsets: torch.Tensor, depth: int) -> torch.Tensor:
    """[n] int64: the valid positions of each depth (`mtp_targets`' mask summed) over sequences given as
    flat `loss_mask` [T] with their `offsets` [N+1] (a nested tensor's values and offsets)."""
    offsets = offsets.to(device=loss_mask.device, dtype=torch.int64)
    lengths = offsets.diff()
    within = torch.arange(loss_mask.shape[0], device=loss_mask.device) - torch.repeat_interleave(offsets[:-1], lengths)
    target = loss_mask.to(torch.bool)
    # depth k's valid positions are the targets at index >= k + 1 of their sequence
    return torch.stack([(target & (within >= k + 1)).sum() for k in range(1, depth + 1)]).to(torch.int64)


__all__ = ["mtp_targets", "mtp_valid_counts", "sequence_ends", "shift_left"]
