"""Model specs by transformers `model_type`: how to read the config, which checkpoint layout to
expect, which transformers class is the numerical reference.

verl sets `model_config.model_type` to the worker role; pick the spec from
`model_config.hf_config.model_type`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .arch import ArchConfig
from .qwen3_5_moe import config as qwen3_5_moe_config
from .qwen3_moe import config as qwen3_moe_config


@dataclass(frozen=True)
class ModelSpec:
    """One model family.

    Attributes:
        family: "qwen3_5_moe" or "qwen3_moe".
        text_config: HF config -> the text config the decoder reads (VL configs hold it in text_config).
        arch_config: text config -> validated ArchConfig.
        hf_causal_lm: transformers' class with the same parameter names (the numerical reference).
        checkpoint_renames: (old prefix, new prefix) applied to checkpoint keys on load.
        checkpoint_skips: key prefixes on disk that are not part of the model (the vision tower for the
            text-only spec).
        mtp_prefix: the prefix of the family's multi-token-prediction tensors on disk (None: it has none);
            they load into the model's `mtp` module when the config has MTP layers, else are skipped
            (`weights.skipped_prefixes`).
        vision_arch: HF config -> validated VisionArch for vision-language specs (`build` then returns
            the model with its vision tower), None for text-only ones.
    """

    family: str
    text_config: Callable
    arch_config: Callable[..., ArchConfig]
    hf_causal_lm: str
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    checkpoint_skips: tuple[str, ...] = ()
    mtp_prefix: str | None = None
    vision_arch: Callable | None = None


QWEN3_5_MOE = ModelSpec(
    family="qwen3_5_moe",
    text_config=qwen3_5_moe_config.text_config,
    arch_config=qwen3_5_moe_config.arch_config,
    hf_causal_lm="Qwen3_5MoeForCausalLM",
    checkpoint_renames=(("model.language_model.", "model."),),
    checkpoint_skips=("model.visual.",),
    mtp_prefix="mtp.",
)

# The vision-language config (`Qwen3_5MoeConfig`, model_type qwen3_5_moe): vision tower + text decoder,
# checkpoint names as on disk (`model.visual.*`, `model.language_model.*`).
QWEN3_5_MOE_VL = ModelSpec(
    family="qwen3_5_moe",
    text_config=qwen3_5_moe_config.text_config,
    arch_config=qwen3_5_moe_config.arch_config,
    hf_causal_lm="Qwen3_5MoeForConditionalGeneration",
    mtp_prefix="mtp.",
    vision_arch=qwen3_5_moe_config.vision_arch,
)

QWEN3_MOE = ModelSpec(
    family="qwen3_moe",
    text_config=qwen3_moe_config.text_config,
    arch_config=qwen3_moe_config.arch_config,
    hf_causal_lm="Qwen3MoeForCausalLM",
)

SPECS: dict[str, ModelSpec] = {
    "qwen3_5_moe_text": QWEN3_5_MOE,
    "qwen3_5_moe": QWEN3_5_MOE_VL,
    "qwen3_moe": QWEN3_MOE,
}


def get_spec(model_type: str) -> ModelSpec:
    """The spec for an HF `model_type`. Raises ValueError naming the supported types."""
    if model_type not in SPECS:
        raise ValueError(f"model_type {model_type!r} has no verl_moe model spec; supported: {sorted(SPECS)}")
    return SPECS[model_type]
