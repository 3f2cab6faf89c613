"""The value model (verl's critic): the causal LM spec with its `lm_head` swapped for a value head.

verl's critic is a token classifier with one label: the decoder's final hidden state at every position
goes through `score` (Linear(D, 1) with a bias), giving one value per token, as transformers'
`...ForTokenClassification` with `num_labels=1` does (`Qwen3MoeForTokenClassification`; transformers has no
such class for Qwen3.5-MoE). The swap keeps every other module of the spec, so the value model has the
actor's parameter names, sharding, ops and fp32 router; its state dict is transformers' token classifier's
(`model.*`, `score.weight`, `score.bias`).

Weights come from either kind of HF folder:
- a value checkpoint (it stores `score.*`, e.g. one our critic exported or transformers'
  `Qwen3MoeForTokenClassification` saved): loaded strictly, value head included;
- a causal LM checkpoint (the actor's, as verl's critic starts from by default): the decoder is loaded
  strictly, `lm_head` is dropped and the value head is drawn as transformers initialises it (weight
  normal(0, initializer_range), bias 0) from a seeded generator.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .causal_lm import MoeCausalLM
from .factory import build
from .ops_config import OpsConfig
from .qwen3_5_moe.vl_model import MoeVisionLM
from .weights import checkpoint_files, load_checkpoint, save_pretrained

VALUE_HEAD = "score"  # transformers' name for a token classifier's head


def is_value_model(model: nn.Module) -> bool:
    """True for a model whose lm_head was swapped for the value head (`add_value_head`)."""
    return hasattr(model, VALUE_HEAD) and not hasattr(model, "lm_head")


def add_value_head(model: MoeCausalLM | MoeVisionLM, generator: torch.Generator | None = None) -> None:
    """Swap `model.lm_head` for `score` = Linear(D, 1) with a bias, in the lm_head's dtype and device, in
    place. With `generator` the head is initialised (weight normal(0, initializer_range), bias 0); on the meta
    device it is left unallocated. The model's arch is marked untied: with no LM head nothing shares the
    embedding. Raises ValueError for a model with MTP layers (they predict tokens through the LM head) or one
    that already has a value head."""
    if is_value_model(model):
        raise ValueError("the model already has a value head")
    if getattr(model, "mtp", None) is not None:
        raise ValueError(
            f"a value model takes no MTP layers (mtp_num_hidden_layers={model.arch.mtp_num_hidden_layers}); "
            "leave model.mtp.enable off for the critic"
        )
    weight = model.lm_head.weight
    del model.lm_head
    model.arch = replace(model.arch, tie_word_embeddings=False)
    model.score = nn.Linear(model.arch.hidden_size, 1, bias=True, dtype=weight.dtype, device=weight.device)
    if generator is not None:
        init_value_head(model, generator)


@torch.no_grad()
def init_value_head(model: nn.Module, generator: torch.Generator) -> None:
    """transformers' init of a token classifier's head: weight normal(0, initializer_range), bias 0."""
    score = getattr(model, VALUE_HEAD)
    draw = torch.empty(score.weight.shape, dtype=torch.float32).normal_(
        0.0, model.arch.initializer_range, generator=generator
    )
    score.weight.copy_(draw)
    score.bias.zero_()


def token_values(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [..., D] -> values [...] fp32: the value head in fp32 (its inputs upcast; D x 1 is cheap)."""
    score = getattr(model, VALUE_HEAD)
    return nn.functional.linear(hidden.float(), score.weight.float(), score.bias.float()).squeeze(-1)


def has_value_head(path: str | os.PathLike) -> bool:
    """True when the HF folder's weights hold the value head (`score.*`)."""
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            if any(key.startswith(VALUE_HEAD + ".") for key in f.keys()):
                return True
    return False


def value_from_pretrained(
    path: str | os.PathLike,
    config,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    ops: OpsConfig | None = None,
    compute_dtype: torch.dtype | None = None,
    text_only: bool = False,
) -> MoeCausalLM | MoeVisionLM:
    """The value model of the HF folder `path` built from `config` (verl's model config): strictly loaded
    from a value checkpoint, or from a causal LM checkpoint with a fresh value head drawn from `seed` (see
    the module docstring). Other arguments as `verl_moe.models.from_pretrained`.

    Raises:
        FileNotFoundError: `path` lacks weight files. ValueError: see `load_checkpoint` / `add_value_head`.
    """
    value_checkpoint = has_value_head(path)
    model = build(config, dtype=dtype, device="meta", ops=ops, compute_dtype=compute_dtype, text_only=text_only)
    if value_checkpoint:
        add_value_head(model)
    model.to_empty(device=torch.device(device))
    if not value_checkpoint and model.arch.tie_word_embeddings:
        model.lm_head.weight = input_embedding(model).weight
    load_checkpoint(model, path)
    if not value_checkpoint:
        add_value_head(model, torch.Generator().manual_seed(seed))
    return model


def input_embedding(model: MoeCausalLM | MoeVisionLM) -> nn.Embedding:
    text = model.model.language_model if isinstance(model, MoeVisionLM) else model.model
    return text.embed_tokens


def save_value_pretrained(model: MoeCausalLM | MoeVisionLM, path: str | os.PathLike) -> None:
    """`save_pretrained` of a value model: its weights (`model.*`, `score.*`) and a config.json naming
    transformers' token classifier with one label (the class exists for Qwen3-MoE; every folder loads back
    through `value_from_pretrained`)."""
    save_pretrained(model, path)
    file = Path(path) / "config.json"
    config = json.loads(file.read_text())
    config["architectures"] = [model.spec.hf_causal_lm.replace("ForCausalLM", "ForTokenClassification")]
    config["num_labels"] = 1
    config.pop("id2label", None)
    config.pop("label2id", None)
    file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
