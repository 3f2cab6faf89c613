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

    forward(packed) -> (log_probs [T] fp32, entropy [T] fp32 or None). The head never builds the
    [T, VOCAB] logits; the head (`ops.logprob.logprob_head`, its kernel resolved once) scales the
    logits by the packed batch's inverse temperature out of place inside the op. It reads
    `lm_head.weight`, which with tied word embeddings is the embedding's (one root-unit parameter,
    `models/fsdp_plan.py`), so its gradient adds to the embedding lookup's. A vision-language
    model (`MoeVisionLM`) also gets the micro-batch's pixels and grids (`packed.media`); a text model
    given media raises ValueError.
    """

    def __init__(self, model: nn.Module, head: LogprobHead):
        super().__init__()
        self.model = model
        self.head = head

    def forward(
        self, packed: PackedBatch, calculate_entropy: bool, entropy_grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if packed.media and not hasattr(self.model.model, "visual"):
            raise ValueError(f"a text checkpoint got multimodal inputs {sorted(packed.media)}")
        out = self.model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            cu_seqlens=packed.cu_seqlens,
            cu_seqlens_cpu=packed.cu_seqlens_cpu,
            **packed.media,
        )
        hidden = out.last_hidden_state[0]
        return self.head(
            hidden,
            self.model.lm_head.weight,
            packed.labels,
            packed.inv_temperature,
            calculate_entropy=calculate_entropy,
            entropy_grad=entropy_grad,
        )


def packed_log_probs(
    module: LogProbModel, packed: PackedBatch, sp: UlyssesGroup | None, calculate_entropy: bool, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`module` (the spec + log-prob head) over a whole packed row: (log_probs [T], entropy [T] or
    None), fp32. Under SP each rank runs its slice (`slice_packed`) and every rank gets all T
    values back (`gather_tokens`), so the loss sees the micro-batch exactly as without SP."""
    if sp is None:
        return module(packed, calculate_entropy, entropy_grad)
    local, pad = slice_packed(packed, sp)
    log_probs, entropy = module(local, calculate_entropy, entropy_grad)
    return sp.gather_tokens(log_probs, pad), None if entropy is None else sp.gather_tokens(entropy, pad)
