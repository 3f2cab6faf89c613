"""What our engines train for verl's critic (`value_model` role): the model spec with its value head
(`models/value_head.py`) as one module, its forward over one packed micro-batch (Ulysses-sliced under SP),
and the critic's configuration checks.

verl's critic TrainingWorker hands the engine the same nested batches as the actor's and expects
`{"values": nested [N, j]}`: one value per token of every sequence, prompt included, read at the state
before each response token (`no_padding_2_padding`, inside verl's `value_loss` and `_compute_values`).

Alphabet: T packed tokens, D hidden.
"""

from __future__ import annotations

import torch
from torch import nn
from verl_moe.engines.batch import PackedBatch, slice_packed
from verl_moe.models.process_groups import UlyssesGroup
from verl_moe.models.value_head import is_value_model, token_values

ROLES = ("language_model", "value_model")


def is_value_role(model_config) -> bool:
    """True when verl builds the engine for a critic: verl's TrainingWorker writes the worker's role
    into `model_config.model_type` ("language_model" or "value_model"), as verl's own engines read it.
    Raises ValueError for another role."""
    role = model_config.model_type
    if role not in ROLES:
        raise ValueError(f"model_config.model_type (the worker's role) must be one of {list(ROLES)}, got {role!r}")
    return role == "value_model"


def check_value_model_config(model_config, engine_config) -> None:
    """Raise ValueError (one line, naming the key) for switches the critic on our engines does not take:
    LoRA (adapters on a value model would need the head trained in full beside them), router replay (it
    replays the actor's routing) and MTP layers (they predict tokens through the LM head the critic lacks)."""
    if model_config.lora_rank > 0:
        raise ValueError(f"critic.model.lora_rank={model_config.lora_rank}: LoRA is not supported for the critic")
    if engine_config.router_replay.mode != "disabled":
        raise ValueError(
            f"router_replay.mode={engine_config.router_replay.mode!r}: router replay is not supported for the critic"
        )
    if model_config.mtp.enable:
        raise ValueError("critic.model.mtp.enable=true: the critic takes no MTP layers")


class ValueModel(nn.Module):
    """The spec with its value head, as one module (FSDP's root unit holds the embeddings, the final norm
    and the head, as for `LogProbModel`).

    forward(packed) -> values [T] fp32 (the head in fp32 over the final hidden states). A vision-language
    model also gets the micro-batch's pixels and grids (`packed.media`); a text model given media raises
    ValueError.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        if not is_value_model(model):
            raise ValueError("ValueModel needs a model with a value head (models.value_head.add_value_head)")
        self.model = model

    def forward(self, packed: PackedBatch) -> torch.Tensor:
        if packed.media and not hasattr(self.model.model, "visual"):
            raise ValueError(f"a text checkpoint got multimodal inputs {sorted(packed.media)}")
        out = self.model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            cu_seqlens=packed.cu_seqlens,
            cu_seqlens_cpu=packed.cu_seqlens_cpu,
            **packed.media,
        )
        return token_values(self.model, out.last_hidden_state[0])


def packed_values(module: ValueModel, packed: PackedBatch, sp: UlyssesGroup | None) -> torch.Tensor:
    """`module` over a whole packed row: values [T] fp32. Under SP each rank runs its slice and every rank
    gets all T values back, so verl's value loss sees the micro-batch exactly as without SP."""
    if sp is None:
        return module(packed)
    local, pad = slice_packed(packed, sp)
    return sp.gather_tokens(module(local), pad)
