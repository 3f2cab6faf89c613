"""`verl-moe align` on the vision-language preset: images in the RL stream as verl's agent
loop lays them out (placeholders in the prompt, `multi_modal_inputs` per sample, 4-row position ids),
through the fp64 reference and the engines.

References: transformers' `get_rope_index` for the position ids; the fp64 reference's log-probs with the
images changed (they must move on the image rows only); the engines against the fp64 reference within
the fp32 tolerances of `DEFAULT_TOLERANCES`.
"""

from __future__ import annotations

import copy

import pytest
import torch
from verl_moe.tools import align
from verl_moe.tools.align import data
from verl_moe.tools.align.backends.reference import fill_old_log_probs

# the streams use verl's GRPO advantage, the engine backends verl itself
pytestmark = pytest.mark.usefixtures("needs_verl")
PRESET = "tiny-qwen3.5-moe-vl"


def _stream(steps: int = 1, seed: int = 3):
    preset = data.get_preset(PRESET)
    config = data.hf_config(preset)
    vision = data.VisionTokens.of(config)
    return config, vision, data.make_stream(preset.stream, data.text_vocab_size(config), steps, seed, vision)


def test_stream_places_images_as_verl_and_transformers_do():
    import transformers

    config, vision, (batch,) = _stream()
    hf = transformers.Qwen3_5MoeForConditionalGeneration(config)
    media = batch["multi_modal_inputs"]
    assert len(media) == batch["input_ids"].shape[0]
    assert any(media) and not all(media)  # image prompts and a text prompt
    for i, m in enumerate(media):
        mask = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i, mask][None]
        grid = m.get("image_grid_thw")
        placeholders = int((ids == vision.image_token_id).sum())
        assert placeholders == (0 if grid is None else int(grid.prod()) // vision.spatial_merge_size**2)
        if grid is not None:
            assert m["pixel_values"].shape == (int(grid.prod()), vision.patch_dim)
        want, _ = hf.model.get_rope_index(ids, (ids == vision.image_token_id).long(), grid, None)
        assert torch.equal(batch["position_ids"][i, 1:, mask], want[:, 0])
        assert torch.equal(batch["position_ids"][i, 0, mask], torch.arange(ids.shape[1]))
    assert (batch["responses"] < vision.first_special_id).all()  # text responses never hit a placeholder
    with pytest.raises(ValueError, match="needs a vision-language model"):
        data.make_batch(data.get_preset(PRESET).stream, 512, torch.Generator().manual_seed(0))


def test_reference_log_probs_see_the_images(tmp_path):
    """The fp64 reference's θ0 log-probs (what every backend's old_log_probs are) move on the image rows
    when their pixels change, and not on the text rows."""
    _, _, stream = _stream()
    model_dir = data.create_model_dir(data.get_preset(PRESET), 0, tmp_path / "model")
    other = copy.deepcopy(stream)
    for m in other[0]["multi_modal_inputs"]:
        if m:
            m["pixel_values"] = m["pixel_values"] + 1.0
    both = [stream[0], other[0]]
    fill_old_log_probs(model_dir, both, 1.0)  # one model load for the two batches
    moved = (both[0]["old_log_probs"] - both[1]["old_log_probs"]).abs().amax(-1)
    has_image = torch.tensor([bool(m) for m in stream[0]["multi_modal_inputs"]])
    assert (moved[has_image] > 1e-6).all() and (moved[~has_image] == 0).all()


def _check_aligned(report: dict, engines: tuple[str, ...]) -> None:
    align.validate_report(report)
    assert report["model"]["model_type"] == "qwen3_5_moe"
    assert [b["status"] for b in report["backends"]] == ["ok"] * (1 + len(engines))
    for pair in report["pairs"]:
        assert pair["ok"], (pair["a"], pair["b"], pair["first_exceeded"])
        assert pair["precision"] == "fp32" and pair["one_step"]["router_flip_rate"] == 0.0
        # the tower's gradients are compared too (zero ones would give no cosine)
        assert pair["one_step"]["grad_cosine"]["vision"] > 1 - 1e-9
    assert report["exit_code"] == 0


@pytest.mark.dist
def test_fsdp2_aligns_with_the_reference_on_images(tmp_path):
    cfg = align.AlignConfig(preset=PRESET, backends=("reference", "fsdp2"), steps=1, out=str(tmp_path), progress=False)
    _check_aligned(align.run(cfg), ("fsdp2",))


@pytest.mark.slow
@pytest.mark.dist
def test_readme_multimodal_job_aligns(tmp_path):
    """The README's multimodal command: reference, fsdp2 and veomni, 2 steps."""
    cfg = align.AlignConfig(
        preset=PRESET, backends=("reference", "fsdp2", "veomni"), steps=2, out=str(tmp_path), progress=False
    )
    _check_aligned(align.run(cfg), ("fsdp2", "veomni"))
