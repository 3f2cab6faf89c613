"""transformers' value model for a tiny config: the reference of the critic tests (import as `hf_value_model`)."""

from __future__ import annotations

import torch
from torch import nn


class DecoderWithScore(nn.Module):
    """transformers' decoder (`AutoModel`) + `score` Linear(D, 1), as transformers' generic token classifier
    builds it, for a model type transformers has no `...ForTokenClassification` of (Qwen3.5-MoE)."""

    def __init__(self, config):
        super().__init__()
        from transformers import AutoModel

        self.model = AutoModel.from_config(config)
        self.score = nn.Linear(config.hidden_size, 1)

    def forward(self, input_ids, position_ids):
        hidden = self.model(input_ids=input_ids, position_ids=position_ids).last_hidden_state
        return self.score(hidden)


def hf_value_model(config, state_dict: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """transformers' value model of `config` in fp32, eager attention, no dropout: its token classifier
    with one label (`AutoModelForTokenClassification`) where transformers has one (Qwen3-MoE), else
    `DecoderWithScore`. With `state_dict` (ours: `model.*`, `score.*`) loaded strictly."""
    from transformers import AutoModelForTokenClassification

    config = type(config).from_dict(config.to_dict())
    config.num_labels, config.classifier_dropout = 1, 0.0
    config._attn_implementation = "eager"
    try:
        model = AutoModelForTokenClassification.from_config(config)
    except ValueError:  # no token classifier for this model type
        model = DecoderWithScore(config)
    model = model.to(torch.float32).eval()
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=True)
    return model


def hf_values(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] values of `hf_value_model` for rows of whole sequences."""
    out = model(input_ids=input_ids, position_ids=position_ids)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return logits.squeeze(-1)
