"""What our engines train: the model spec and the fused log-prob head as one module, and its forward
over one packed micro-batch, sliced over a Ulysses group when sequence parallelism is on.

Alphabet: T packed tokens, D hidden, VOCAB vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn
from verl_moe.engines.batch import PackedBatch, slice_packed
from verl_moe.models.process_groups import UlyssesGroup
from verl_moe.ops.logprob import LogprobHead


class LogProbModel(nn.Module):
    """The spec plus the fused log-prob head, as one module, so that FSDP's root unit (embeddings,
    final norm, lm_head) is unsharded for the head call and its gradients reduce-scatter normally.

    forward(packed, calculate_entropy, entropy_grad, mtp_targets=None) -> (log_probs [T] fp32, entropy [T]
    fp32 or None, MTP cross-entropy sums [n] fp32 or None: `mtp_cross_entropy`, given the micro-batch's
    `mtp_targets` (labels, mask) from `engines/mtp_loss.py`). The head never builds the
    [T, VOCAB] logits; the head (`ops.logprob.logprob_head`, its kernel resolved once) scales the
    logits by the packed batch's inverse temperature out of place inside the op. It reads
    `lm_head.weight`, which with tied word embeddings is the embedding's (one root-unit parameter,
    `models/fsdp_plan.py`), so its gradient adds to the embedding lookup's. A vision-language
    model (`MoeVisionLM`) also gets the micro-batch's pixels and grids (`packed.media`); a text model
    given media raises ValueError.
    """

    def __init__(self, model: nn.Module, head: LogprobHead, mtp_detach: bool = False):
        super().__init__()
        self.model = model
        self.head = head
        self.mtp_detach = mtp_detach  # verl's model.mtp.detach_encoder

    def forward(
        self,
        packed: PackedBatch,
        calculate_entropy: bool,
        entropy_grad: bool,
        mtp_targets: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        if packed.media and not hasattr(self.model.model, "visual"):
            raise ValueError(f"a text checkpoint got multimodal inputs {sorted(packed.media)}")
        if packed.media and mtp_targets is not None:
            # the MTP layer would see the placeholders' token embeddings, not the image features
            raise ValueError("the MTP loss (mtp_loss_scaling_factor > 0) does not take image or video inputs")
        out = self.model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            cu_seqlens=packed.cu_seqlens,
            cu_seqlens_cpu=packed.cu_seqlens_cpu,
            **packed.media,
        )
        hidden = out.last_hidden_state[0]
        log_probs, entropy = self.head(
            hidden,
            self.model.lm_head.weight,
            packed.labels,
            packed.inv_temperature,
            calculate_entropy=calculate_entropy,
            entropy_grad=entropy_grad,
        )
        mtp_ce = None if mtp_targets is None else self.mtp_cross_entropy(out.last_hidden_state, packed, *mtp_targets)
        return log_probs, entropy, mtp_ce

    def mtp_cross_entropy(
        self, hidden: torch.Tensor, packed: PackedBatch, labels: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """[n] fp32: per MTP depth, the cross-entropy summed over the valid positions `mask` [n, T] of
        predicting `labels` [n, T] from the MTP module's hidden states (`engines/mtp_loss.py`), through the
        same head at temperature 1 (no [T, VOCAB] logits). With `mtp_detach` the MTP loss trains the MTP
        module and the shared lm_head only (its inputs detached, as verl's detach_encoder)."""
        depths = self.model.mtp_hidden_states(
            hidden,
            packed.input_ids,
            packed.position_ids,
            packed.cu_seqlens,
            packed.cu_seqlens_cpu,
            detach_inputs=self.mtp_detach,
        )
        ones = torch.ones_like(packed.inv_temperature)
        sums = []
        for depth_hidden, depth_labels, depth_mask in zip(depths, labels, mask):
            log_probs, _ = self.head(
                depth_hidden[0],
                self.model.lm_head.weight,
                depth_labels,
                ones,
                calculate_entropy=False,
                entropy_grad=False,
            )
            sums.append(-(log_probs * depth_mask).sum())
        return torch.stack(sums)


def packed_log_probs(
    module: LogProbModel,
    packed: PackedBatch,
    sp: UlyssesGroup | None,
    calculate_entropy: bool,
    entropy_grad: bool,
    mtp_targets: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`module` (the spec + log-prob head) over a whole packed row: (log_probs [T], entropy [T] or
    None, MTP cross-entropy sums [n] or None), fp32. Under SP each rank runs its slice (`slice_packed`)
    and every rank gets all T values back (`gather_tokens`), so the loss sees the micro-batch exactly as
    without SP (the engine config refuses the MTP loss under SP)."""
    if sp is None:
        return module(packed, calculate_entropy, entropy_grad, mtp_targets)
    local, pad = slice_packed(packed, sp)
    log_probs, entropy, _ = module(local, calculate_entropy, entropy_grad)
    return sp.gather_tokens(log_probs, pad), None if entropy is None else sp.gather_tokens(entropy, pad), None
