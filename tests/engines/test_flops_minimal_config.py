"""verl's `FlopsCounter`, with our count in its table, on configs that hold only the fields verl's own count
reads: a plain object per model, as verl's FLOPs tests build them. Two references on the same fields:

- transformers: our count on the model type's transformers config class built from those fields (every
  other field at the class's default), so a field the object lacks means the class's default;
- verl's own formula for the model type, which differs from ours by the conventions `models/flops.py`
  states: verl counts the input embedding as a product (6 V D per token, training step) and attention
  over s^2 query-key pairs where ours counts the s (s + 1) / 2 causal ones (6 K H per token and
  full-attention layer more for ours); for Qwen3.5 verl's GatedDeltaNet term is 15 K V HV per token and
  layer, ours 3 x 6.
"""

from __future__ import annotations

import pytest
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig, Qwen3MoeConfig
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeVisionConfig
from verl.utils import flops_counter
from verl.utils.flops_counter import FlopsCounter
from verl_moe.models import flops
from verl_moe.models.qwen3_5_moe.config import vision_arch

SEQLENS = [512, 1024, 2048]
FRAMES = [64, 256]

# the fields verl's count reads, at Qwen3-30B-A3B's and Qwen3.5-35B-A3B's text shapes
QWEN3_MOE = dict(
    hidden_size=2048, vocab_size=151936, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, moe_intermediate_size=768, num_experts_per_tok=8, num_experts=128,
)  # fmt: skip
QWEN3_5_MOE_TEXT = dict(
    hidden_size=2048, vocab_size=248320, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
    moe_intermediate_size=512, shared_expert_intermediate_size=512,
)  # fmt: skip
# the fields verl's vision count reads
VISION = dict(
    depth=4, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=2048, spatial_merge_size=2,
    in_channels=3, temporal_patch_size=2, patch_size=16,
)  # fmt: skip


class Config:
    """Only the attributes it is given."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def _ours(config, seqlens=SEQLENS, **kwargs) -> float:
    """FLOPs of a training step as verl's FlopsCounter reports them (delta_time 1 s)."""
    achieved, _ = FlopsCounter(config).estimate_flops(seqlens, 1.0, **kwargs)
    return achieved * 1e12


def _layer_counts(text_config) -> tuple[int, int]:
    full = sum(t == "full_attention" for t in text_config.layer_types)
    return full, len(text_config.layer_types) - full


def test_our_count_is_in_verls_table():
    for model_type in ("qwen3_moe", "qwen3_5_moe_text", "qwen3_5_moe"):
        assert flops_counter.ESTIMATE_FUNC[model_type] is flops.estimate_tflops


def test_qwen3_moe_minimal_config():
    minimal = Config(model_type="qwen3_moe", **QWEN3_MOE)
    ours = _ours(minimal)
    assert ours == pytest.approx(_ours(Qwen3MoeConfig(**QWEN3_MOE)), rel=1e-12)

    verl = flops_counter._estimate_qwen2_moe_flops(minimal, sum(SEQLENS), SEQLENS, 1.0) * 1e12
    c, T = QWEN3_MOE, sum(SEQLENS)
    embedding = 6 * c["vocab_size"] * c["hidden_size"] * T
    causal = 6 * c["head_dim"] * c["num_attention_heads"] * c["num_hidden_layers"] * T
    assert ours == pytest.approx(verl - embedding + causal, rel=1e-12)


@pytest.mark.parametrize("form", ["text", "vl_nested", "vl_flat"])
def test_qwen3_5_moe_minimal_config(form):
    """`qwen3_5_moe_text`; the vision-language `qwen3_5_moe` with its text fields in `text_config` (an object)
    or at the top level (verl reads a config without `text_config` as the text config)."""
    if form == "text":
        minimal = Config(model_type="qwen3_5_moe_text", **QWEN3_5_MOE_TEXT)
    elif form == "vl_nested":
        minimal = Config(model_type="qwen3_5_moe", text_config=Config(**QWEN3_5_MOE_TEXT))
    else:
        minimal = Config(model_type="qwen3_5_moe", **QWEN3_5_MOE_TEXT)
    ours = _ours(minimal)
    text = Qwen3_5MoeTextConfig(**QWEN3_5_MOE_TEXT)
    assert ours == pytest.approx(_ours(text), rel=1e-12)

    verl = flops_counter._estimate_qwen3_5_flops(minimal, sum(SEQLENS), SEQLENS, 1.0) * 1e12
    c, T = QWEN3_5_MOE_TEXT, sum(SEQLENS)
    full_layers, linear_layers = _layer_counts(text)  # the class's full_attention_interval, as verl's fallback
    assert full_layers and linear_layers
    embedding = 6 * c["vocab_size"] * c["hidden_size"] * T
    causal = 6 * c["head_dim"] * c["num_attention_heads"] * full_layers * T
    recurrence = (18 - 15) * c["linear_key_head_dim"] * c["linear_value_head_dim"] * c["linear_num_value_heads"]
    assert ours == pytest.approx(verl - embedding + causal + recurrence * T * linear_layers, rel=1e-12)


def test_qwen3_5_moe_minimal_vision_config():
    """With images, the tower's count on the vision fields verl reads equals ours on transformers' vision
    config class built from them."""
    minimal = Config(model_type="qwen3_5_moe", text_config=Config(**QWEN3_5_MOE_TEXT), vision_config=Config(**VISION))
    tower = _ours(minimal, images_seqlens=FRAMES) - _ours(minimal, images_seqlens=None)
    reference = Qwen3_5MoeConfig(text_config=QWEN3_5_MOE_TEXT, vision_config=Qwen3_5MoeVisionConfig(**VISION))
    expected = flops.TRAIN_FACTOR * flops.vision_flops(vision_arch(reference), FRAMES)
    assert tower == pytest.approx(expected, rel=1e-9)


def test_unusable_configs_fail_in_one_line():
    with pytest.raises(ValueError, match="model_type") as missing:
        flops.estimate_tflops(Config(**QWEN3_MOE), sum(SEQLENS), SEQLENS, 1.0)
    bad_layers = Config(model_type="qwen3_5_moe_text", **QWEN3_5_MOE_TEXT, layer_types=["full_attention"])
    with pytest.raises(ValueError, match="layer_types") as refused:
        flops.estimate_tflops(bad_layers, sum(SEQLENS), SEQLENS, 1.0)
    for exc in (missing, refused):
        assert "\n" not in str(exc.value), str(exc.value)
