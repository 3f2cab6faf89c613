"""Images through our engines: a vision-language checkpoint builds the whole model (tower +
text decoder) in both engines, verl's multimodal batches (`multi_modal_inputs` per sample, 4-row
position ids) go through packing and micro-batching into the vision tower.

Checked against transformers' `Qwen3_5MoeForConditionalGeneration` with the same weights, one
sample at a time (fp32, response-token log-probs max abs 1e-5); `train_batch` moves the log-probs
and the tower's weights; `freeze_vision_tower` keeps the tower out of the optimizer and unchanged;
a grid that does not match its pixels is a ValueError naming both counts; two gloo ranks of which
only one holds images (the other runs the tower on a dummy image, so FSDP's collectives match).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist import spawn
from engine_setup import (
    IMAGE,
    build_engine,
    build_veomni_engine,
    grpo_actor_config,
    hf_vision_lm,
    hf_vl_log_probs,
    make_vl_batch,
    ppo_loss_fn,
    rank_slice,
    write_tiny_vl_model,
)
from verl.utils import tensordict_utils as tu
from verl_moe.ops.compare import assert_rel_rms

GRIDS = [[[1, 4, 4]], [], [[1, 2, 4], [1, 2, 2]], []]
SP_GRIDS = [[], [[1, 8, 4]], [], [[1, 2, 2]]]  # the 8-token image's placeholders sit across the middle
BUILDERS = {"fsdp2": build_engine, "veomni": build_veomni_engine}


@pytest.fixture
def world_of_one():
    from dist import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    path = write_tiny_vl_model(str(tmp_path_factory.mktemp("vl") / "model"))
    return path, hf_vision_lm(path)


def _infer(engine, data) -> list[torch.Tensor]:
    tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    with engine.eval_mode():
        return list(engine.infer_batch(data)["model_output"]["log_probs"].unbind())


def _max_diff(got: list[torch.Tensor], want: torch.Tensor) -> float:
    # a sequence's last entry predicts the next packed sequence's token: never read by verl
    return max((g[:-1] - w[:-1]).abs().max().item() for g, w in zip(got, want.unbind()))


def _train_step(engine, data) -> None:
    data["old_log_probs"] = torch.full(data["responses"].shape, -4.5)
    data["ref_log_prob"] = torch.full(data["responses"].shape, -4.6)
    tu.assign_non_tensor(data, global_batch_size=len(data), use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    with engine.train_mode():
        engine.train_batch(data, ppo_loss_fn(grpo_actor_config()))


def _weights(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().full_tensor().clone() for n, p in engine.module.named_parameters()}


def _visual(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().full_tensor().clone() for n, p in engine.module.named_parameters() if ".visual." in n}


@pytest.mark.parametrize("backend", ["fsdp2", "veomni"])
def test_image_batch_matches_transformers_and_trains(vl_model, world_of_one, backend):
    path, hf = vl_model
    data = make_vl_batch(GRIDS, 5, seed=1, hf=hf)
    with torch.no_grad():
        want = hf_vl_log_probs(hf, data)
    engine = BUILDERS[backend](path)
    assert any(".visual.blocks.1." in n for n, _ in engine.module.named_parameters())
    before = _infer(engine, data.clone())
    assert _max_diff(before, want) <= 1e-5
    tower = _visual(engine)
    _train_step(engine, make_vl_batch(GRIDS, 5, seed=1, hf=hf))
    after = _infer(engine, data.clone())
    assert _max_diff(after, want) > 1e-4  # the step moved the log-probs
    assert all(not torch.equal(tower[n], t) for n, t in _visual(engine).items()), "tower weights did not change"


def test_video_batch_and_the_vl_checkpoint_export(vl_model, world_of_one, tmp_path):
    """Videos (and an image beside one) through packing and the tower: log-probs equal transformers';
    after a step the `hf_model` export is a VL checkpoint that transformers loads with every tensor equal
    to the engine's (tower included) and the same log-probs as the engine."""
    from verl.trainer.config import CheckpointConfig

    path, hf = vl_model
    grids, clips = [[[1, 2, 2]], [], []], [[[2, 4, 4]], [[2, 2, 2]], []]
    data = make_vl_batch(grids, 5, seed=7, hf=hf, videos=clips)
    assert sum("pixel_values_videos" in getattr(m, "data", m) for m in data["multi_modal_inputs"]) == 2
    with torch.no_grad():
        want = hf_vl_log_probs(hf, data)
    contents = CheckpointConfig(save_contents=["model", "hf_model"], load_contents=["model"])
    engine = build_engine(path, checkpoint_config=contents)
    assert _max_diff(_infer(engine, data.clone()), want) <= 1e-5
    _train_step(engine, make_vl_batch(grids, 5, seed=7, hf=hf, videos=clips))
    engine.save_checkpoint(str(tmp_path / "step1"), global_step=1)
    import transformers

    exported = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(
        str(tmp_path / "step1" / "huggingface"), attn_implementation="eager", dtype=torch.float32
    ).eval()  # transformers' own loader, not ours
    weights = {n: t.clone() for n, t in engine.get_per_tensor_param(layout="hf")[0]}
    assert any(n.startswith("model.visual.") for n in weights)
    state = exported.state_dict()
    assert sorted(state) == sorted(weights) and all(torch.equal(state[n], t) for n, t in weights.items())
    with torch.no_grad():
        assert _max_diff(_infer(engine, data.clone()), hf_vl_log_probs(exported, data)) <= 1e-5


def test_freeze_vision_tower(vl_model, world_of_one):
    path, hf = vl_model
    engine = build_engine(path, freeze_vision_tower=True)
    stepped = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    named = dict(engine.module.named_parameters())
    assert all(not p.requires_grad and id(p) not in stepped for n, p in named.items() if ".visual." in n)
    assert all(id(p) in stepped for n, p in named.items() if ".visual." not in n)
    tower = _visual(engine)
    text = named["model.model.language_model.layers.0.mlp.gate.weight"].detach().full_tensor().clone()
    _train_step(engine, make_vl_batch(GRIDS, 5, seed=1, hf=hf))
    assert all(torch.equal(tower[n], t) for n, t in _visual(engine).items())
    assert not torch.equal(text, named["model.model.language_model.layers.0.mlp.gate.weight"].detach().full_tensor())


def test_grid_that_does_not_match_the_pixels(vl_model, world_of_one):
    path, hf = vl_model
    data = make_vl_batch(GRIDS[:2], 5, seed=2, hf=hf)
    media = data["multi_modal_inputs"][0]
    media = getattr(media, "data", media)
    media["pixel_values"] = media["pixel_values"][:15]
    engine = build_engine(path, freeze_vision_tower=True)
    with pytest.raises(ValueError, match=r"covers 16 patches but image pixel values hold 15"):
        _infer(engine, data)


def _one_rank_has_images(rank: int, world_size: int, path: str) -> None:
    hf = hf_vision_lm(path)
    # rank 0's half holds images, rank 1's none: rank 1 runs the tower on a dummy image
    # this rank's half as verl's dispatch cuts it (tu.chunk_tensordict)
    grids = [[[1, 4, 4]], [[1, 2, 2]], [], []]
    local = rank_slice(make_vl_batch(grids, 5, seed=3, hf=hf), rank, world_size)
    with torch.no_grad():
        want = hf_vl_log_probs(hf, local)
    for builder in (build_engine, build_veomni_engine):
        engine = builder(path)
        assert _max_diff(_infer(engine, local.clone()), want) <= 1e-5, (builder.__name__, rank)
        _train_step(engine, rank_slice(make_vl_batch(grids, 5, seed=3, hf=hf), rank, world_size))
        assert _max_diff(_infer(engine, local.clone()), want) > 1e-4, (builder.__name__, rank)


@pytest.mark.dist
def test_only_one_rank_has_images(tmp_path):
    spawn(_one_rank_has_images, 2, write_tiny_vl_model(str(tmp_path / "vl")))


@pytest.mark.dist
@pytest.mark.slow
def test_training_worker_with_images(tmp_path):
    """verl's own TrainingWorker, 2 Ray workers on the cpu platform (MoeFsdp2Engine, two data-parallel
    ranks, images on one): infer log-probs equal transformers', train_mini_batch moves them."""
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig
    from verl.workers.utils.padding import no_padding_2_padding
    from verl_moe.engines.config import MoeFsdp2EngineConfig

    path = write_tiny_vl_model(str(tmp_path / "vl"))
    hf = hf_vision_lm(path)
    grids = [[[1, 4, 4]], [[1, 2, 2]], [], []]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        config = TrainingWorkerConfig(
            model_type="language_model",
            model_config=HFModelConfig(path=path, load_tokenizer=False),
            engine_config=MoeFsdp2EngineConfig(
                mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32"},
                use_dynamic_bsz=False,
                micro_batch_size_per_gpu=1,
                infer_micro_batch_size_per_gpu=2,
            ),
            optimizer_config=FSDPOptimizerConfig(lr=1e-3),
            checkpoint_config=CheckpointConfig(),
        )
        workers = RayWorkerGroup(
            resource_pool=RayResourcePool(process_on_nodes=[2]),
            ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(TrainingWorker), config=config),
        )
        workers.reset()
        data = make_vl_batch(grids, 5, seed=4, hf=hf)
        with torch.no_grad():
            want = no_padding_2_padding(hf_vl_log_probs(hf, data), data)

        def infer():
            batch = make_vl_batch(grids, 5, seed=4, hf=hf)
            tu.assign_non_tensor(batch, compute_loss=False)
            got = tu.get(workers.infer_batch(batch).get(), "log_probs")
            return ((no_padding_2_padding(got, data) - want).abs() * data["response_mask"]).max().item()

        assert infer() <= 1e-5
        train = make_vl_batch(grids, 5, seed=4, hf=hf)
        train["old_log_probs"] = torch.full(train["responses"].shape, -4.5)
        train["ref_log_prob"] = torch.full(train["responses"].shape, -4.6)
        workers.set_loss_fn(ppo_loss_fn(grpo_actor_config()))
        tu.assign_non_tensor(
            train, global_batch_size=4, mini_batch_size=4, epochs=1, seed=1, dataloader_kwargs={"shuffle": False}
        )
        metrics = tu.get(workers.train_mini_batch(train).get(), "metrics")
        assert metrics["grad_norm_nonfinite"] == [0.0, 0.0]
        assert infer() > 1e-4
    finally:
        ray.shutdown()


def test_ulysses_slicing_of_multimodal_rows(vl_model):
    """Packing reads verl's 4-row position ids whatever nested layout torch chose. Under SP a rank's
    slice of them is each row's slice of the text path (the pad counts on per row); a micro-batch with
    images is refused, naming sequence parallelism."""
    from dataclasses import replace

    from verl_moe.engines.batch import pack_micro_batch, slice_packed
    from verl_moe.models.process_groups import UlyssesGroup

    _, hf = vl_model
    # two sequences of equal length: torch then stores the nested 4-row ids with the rows ragged
    data = make_vl_batch([[], []], 4, seed=5, hf=hf)
    assert data["input_ids"].offsets().diff().unique().numel() == 1
    rows = torch.cat(list(data["position_ids"].unbind()), dim=-1)
    tu.maybe_fix_3d_position_ids(data)  # what verl's infer_batch does first
    packed = pack_micro_batch(data, torch.device("cpu"))
    assert torch.equal(packed.position_ids[:, 0], rows)
    for rank in range(3):
        sp = UlyssesGroup(group=None, size=3, rank=rank)
        local, pad = slice_packed(packed, sp)
        for row in range(4):
            text, text_pad = slice_packed(replace(packed, position_ids=packed.position_ids[row]), sp)
            assert pad == text_pad and torch.equal(local.position_ids[row], text.position_ids)
    with_image = pack_micro_batch(make_vl_batch([[[1, 2, 2]], []], 4, seed=5, hf=hf), torch.device("cpu"))
    for rank in range(2):  # the pixels and grids stay whole on every rank (the tower runs on all images)
        local, _ = slice_packed(with_image, UlyssesGroup(group=None, size=2, rank=rank))
        assert local.media.keys() == with_image.media.keys()
        assert all(torch.equal(local.media[k], with_image.media[k]) for k in local.media)


def _sp2_with_images_equals_sp1(rank: int, world_size: int, path: str) -> None:
    """SP=2 (dp=1) against SP=1 (dp=2): infer log-probs (equal, and equal to transformers'), then one
    train step (loss, grad norm, every updated weight, the tower's included)."""
    hf = hf_vision_lm(path)
    data = make_vl_batch(SP_GRIDS, 5, seed=6, hf=hf)
    # an image's placeholders straddle the two ranks' shares of the packed row
    ids = data["input_ids"].values()
    half = (ids.numel() + 1) // 2
    assert (ids[:half] == IMAGE).any() and (ids[half:] == IMAGE).any()
    with torch.no_grad():
        want = hf_vl_log_probs(hf, data)
    sp1, sp2 = build_engine(path), build_engine(path, ulysses_sequence_parallel_size=2)
    before = _weights(sp1)
    for engine in (sp1, sp2):
        batch = data.clone()
        tu.assign_non_tensor(batch, use_dynamic_bsz=False, micro_batch_size_per_gpu=len(SP_GRIDS))
        with engine.eval_mode():
            got = list(engine.infer_batch(batch)["model_output"]["log_probs"].unbind())
        assert _max_diff(got, want) <= 1e-5
    results = []
    for engine, batch in ((sp1, rank_slice(data, rank, world_size)), (sp2, data.clone())):
        batch["old_log_probs"] = torch.full(batch["responses"].shape, -4.5)
        batch["ref_log_prob"] = torch.full(batch["responses"].shape, -4.6)
        tu.assign_non_tensor(batch, global_batch_size=len(SP_GRIDS), use_dynamic_bsz=False, micro_batch_size_per_gpu=1)
        with engine.train_mode():
            out = engine.train_batch(batch, ppo_loss_fn(grpo_actor_config()))
        loss = torch.tensor(sum(out["loss"]))
        dist.all_reduce(loss, group=engine.get_data_parallel_group())
        results.append((loss.item() / engine.get_data_parallel_size(), out["metrics"]["grad_norm"]))
    (loss1, norm1), (loss2, norm2) = results
    assert abs(loss2 - loss1) <= 1e-5 * abs(loss1) and abs(norm2 - norm1) <= 1e-5 * norm1, results
    weights1, weights2 = _weights(sp1), _weights(sp2)
    assert any(not torch.equal(weights1[n], before[n]) for n in weights1 if ".visual." in n)
    for name, tensor in weights1.items():
        assert_rel_rms(name, tensor, weights2[name], 1e-5)


@pytest.mark.dist
def test_images_under_ulysses_sp2_equal_sp1(tmp_path):
    spawn(_sp2_with_images_equals_sp1, 2, write_tiny_vl_model(str(tmp_path / "vl")))
