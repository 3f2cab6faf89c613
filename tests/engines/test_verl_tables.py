"""verl's tables keyed by HF model type, as the plugin fills them at `import verl`: the FLOPs count
behind `perf/mfu/actor` and the Continuous Token builder family of the agent loop, for each of our
model types. The FLOPs count itself is tested against the models in tests/models/test_flops.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from engine_setup import tiny_config, tiny_vl_config
from transformers import Qwen3MoeConfig
from verl.utils.flops_counter import FlopsCounter
from verl.utils.tokenizer import continuous_token_wiring as ct
from verl_moe.models import flops, get_spec
from verl_moe.models.registry import SPECS


def tiny_qwen3_moe() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
    )


CONFIGS = {"qwen3_5_moe_text": tiny_config, "qwen3_5_moe": tiny_vl_config, "qwen3_moe": tiny_qwen3_moe}
SEQLENS = [5, 17, 1]
FRAMES = [16, 24, 24]  # images_seqlens: patches of an image's frame and of a two-frame video's


def test_configs_cover_every_model_type():
    assert sorted(CONFIGS) == sorted(SPECS)


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_mfu_counts_our_flops(model_type, capsys):
    config = CONFIGS[model_type]()
    assert config.model_type == model_type
    counter = FlopsCounter(config)
    assert "MFU will always be zero" not in capsys.readouterr().out
    spec = get_spec(model_type)
    arch = spec.arch_config(spec.text_config(config))
    seconds = 0.25
    achieved, _ = counter.estimate_flops(SEQLENS, seconds, images_seqlens=None)
    expected = flops.TRAIN_FACTOR * flops.forward_flops(arch, SEQLENS)
    assert achieved * seconds * 1e12 == pytest.approx(expected, rel=1e-12)
    with_images, _ = counter.estimate_flops(SEQLENS, seconds, images_seqlens=FRAMES)
    tower = flops.vision_flops(spec.vision_arch(config), FRAMES) if spec.vision_arch else 0
    assert (with_images - achieved) * seconds * 1e12 == pytest.approx(flops.TRAIN_FACTOR * tower, rel=1e-9)


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_continuous_token_family_without_fallback_warning(model_type, caplog):
    """Each of our types resolves to the family verl gives Qwen3.5 / Qwen3 checkpoints (the text-only
    Qwen3.5 config shares the VL one's tokenizer and chat template), with no fallback warning."""
    with caplog.at_level(logging.WARNING, logger=ct.logger.name):
        family = ct.infer_continuous_token_model_family(hf_model_type=model_type)
    assert not [r for r in caplog.records if "No model-specific Continuous Token builder" in r.getMessage()]
    same_tokenizer = "qwen3_moe" if model_type == "qwen3_moe" else "qwen3_5_moe"
    assert family == ct._MODEL_TYPE_TO_FAMILY[same_tokenizer]


_OVERRIDE_OFF = """
from verl.utils import flops_counter
from verl_moe.models.flops import estimate_tflops
print("OURS", sorted(t for t, f in flops_counter.ESTIMATE_FUNC.items() if f is estimate_tflops))
"""


def test_override_off_keeps_verls_own_entries():
    """With VERL_MOE_OVERRIDE=0 verl's engines serve every model: its own FLOPs entries stay, ours only
    fill the type it lacks."""
    env = {**os.environ, "VERL_MOE_OVERRIDE": "0"}
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", _OVERRIDE_OFF], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    ours = [line for line in out.stdout.splitlines() if line.startswith("OURS ")]
    assert ours == ["OURS ['qwen3_5_moe_text']"]
