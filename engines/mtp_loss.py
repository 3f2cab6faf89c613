"""The multi-token-prediction loss in our engines, under verl's `model.mtp.enable_train` (the model side is
`models/mtp.py` and `MoeCausalLM.mtp_hidden_states`).

Megatron's semantics over verl's batches: for each MTP depth k, the cross-entropy of predicting token
t+k+1 at position t, averaged over the valid positions (token t+k+1 in t's sequence and a target of
verl's `loss_mask`: per token in SFT batches, the response tokens in RL ones, `token_loss_mask`); the
depths' means averaged, times `mtp_loss_scaling_factor`, added to the policy / SFT loss. verl averages its
loss over the tokens of the whole mini-batch (`batch_num_tokens` over the data-parallel group, times
dp_size against FSDP's gradient average), so the MTP mean is taken the same way: each micro-batch adds
its positions' sum over the mini-batch's count, and micro-batching or the split over ranks does not
change the gradient.

Alphabet: n MTP depths, T packed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl_moe.engines.batch import PackedBatch
from verl_moe.models.mtp import mtp_targets, mtp_valid_counts
from verl_moe.ops import device


@dataclass(frozen=True)
class MtpLoss:
    """One mini-batch's MTP loss settings: scale (the factor), counts [n] fp64 on the host (valid positions
    of each depth over the data-parallel group's batch), dp_size."""

    scale: float
    counts: torch.Tensor
    dp_size: int

    @property
    def depth(self) -> int:
        return self.counts.numel()

    def term(self, ce_sums: torch.Tensor) -> torch.Tensor:
        """The micro-batch's share of the loss from its per-depth cross-entropy sums [n] (fp32): scale / n
        * sum_k ce_sums[k] / counts[k] * dp_size (a depth without valid positions adds 0)."""
        denominators = self.counts.clamp_min(1).to(device=ce_sums.device, dtype=ce_sums.dtype)
        return (ce_sums / denominators).sum() * (self.scale / self.depth * self.dp_size)


def token_loss_mask(data: TensorDict) -> torch.Tensor:
    """verl's `loss_mask` of `data` per token of the packed sequences, [T] (`input_ids.values()`' order).
    SFT batches hold it per token (nested like input_ids): its values. RL batches hold it per response
    token, nested [N, r_j] or padded [N, R]: each row is placed on its sequence's last response tokens,
    where verl's `no_padding_2_padding` reads the response (a padded row's length from nested `responses`,
    or from `attention_mask` after the padded prompts)."""
    loss_mask, offsets = data["loss_mask"], data["input_ids"].offsets()
    if loss_mask.is_nested and torch.equal(loss_mask.offsets().to(offsets.dtype), offsets):
        return loss_mask.values()
    if loss_mask.is_nested:
        rows = loss_mask.unbind()
    else:
        prompts, responses = data["prompts"], data["responses"]
        if prompts.is_nested:
            lengths = responses.offsets().diff().tolist()
        else:
            lengths = data["attention_mask"][:, prompts.shape[1] :].sum(dim=1).tolist()
        rows = [row[:length] for row, length in zip(loss_mask, lengths)]
    ends = offsets[1:].tolist()
    out = rows[0].new_zeros(ends[-1])
    for end, row in zip(ends, rows):
        out[end - row.shape[0] : end] = row
    return out


def batch_mtp_loss(data: TensorDict, depth: int, scale: float, dp_group, dp_size: int) -> MtpLoss:
    """`MtpLoss` of verl's batch `data`: the valid positions of each of the `depth` depths summed over the
    data-parallel group (one all-reduce)."""
    offsets = data["input_ids"].offsets()
    counts = mtp_valid_counts(token_loss_mask(data), offsets, depth).to(torch.float64)
    if dist.is_initialized() and dist.get_world_size(dp_group) > 1:
        # NCCL / HCCL reduce device tensors only
        on_device = counts.to(device.current_device())
        dist.all_reduce(on_device, group=dp_group)
        counts = on_device.cpu()
    return MtpLoss(scale=scale, counts=counts, dp_size=dp_size)


def micro_batch_targets(micro_batch: TensorDict, packed: PackedBatch, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels [n, T] int64, mask [n, T] bool) of one packed micro-batch (`models.mtp.mtp_targets`)."""
    loss_mask = token_loss_mask(micro_batch).to(packed.input_ids.device)[None]
    labels, mask = mtp_targets(packed.input_ids, loss_mask, depth, packed.cu_seqlens)
    return labels[:, 0], mask[:, 0]


def micro_batch_mean(ce_sums: torch.Tensor, mask: torch.Tensor) -> float:
    """The metric `mtp_loss`: the micro-batch's MTP cross-entropy per valid position, averaged over the
    depths (unscaled; 0 for a depth without valid positions)."""
    counts = mask.sum(dim=-1).clamp_min(1).to(ce_sums.dtype)
    return float((ce_sums.detach() / counts).mean())


__all__ = ["MtpLoss", "batch_mtp_loss", "micro_batch_mean", "micro_batch_targets", "token_loss_mask"]
