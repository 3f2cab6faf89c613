"""Every engine role verl builds for a GRPO run, as verl builds it: the actor (trainable, the
strategy's own optimizer config) and the reference model (`forward_only`, a plain
`OptimizerConfig()`: verl/workers/config/actor.py gives the ref no optimizer section). verl builds
no critic for GRPO, and our engines serve no value model.

The reference engine of both backends (fsdp2; veomni, on 1 rank and with the experts split over
2 ranks) must
build without an optimizer and give the log-probs of plain autograd through the spec (max abs
1e-5, fp32) and of the actor engine before any update (so the GRPO KL starts at 0). A trainable
veomni engine given a plain OptimizerConfig is a ValueError naming the config it needs, raised
before any process group is touched.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import verl_moe.models as vm
from dist import spawn
from engine_setup import make_batch, rank_slice, reference_log_probs, write_tiny_model
from verl.utils import tensordict_utils as tu
from verl.workers.config import FSDPOptimizerConfig, HFModelConfig, OptimizerConfig, VeOmniOptimizerConfig
from verl.workers.engine import EngineRegistry
from verl_moe.engines.config import MoeFsdp2EngineConfig, MoeVeOmniEngineConfig
from verl_moe.engines.veomni import MoeVeOmniEngine

BATCH, PROMPT, RESPONSE = 4, 5, 6
FP32 = {
    "fsdp2": dict(mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32"}),
    "veomni": dict(param_dtype="fp32"),
}
ENGINE_CONFIGS = {"fsdp2": MoeFsdp2EngineConfig, "veomni": MoeVeOmniEngineConfig}
ACTOR_OPTIMIZERS = {"fsdp2": FSDPOptimizerConfig, "veomni": VeOmniOptimizerConfig}


def _build(path: str, backend: str, role: str, **engine_overrides):
    """The engine verl's ActorRolloutRefWorker builds for `role` ("actor" or "ref")."""
    kwargs = dict(use_dynamic_bsz=False, micro_batch_size_per_gpu=2, infer_micro_batch_size_per_gpu=2)
    kwargs.update(FP32[backend], **engine_overrides)
    if backend == "fsdp2":
        kwargs["strategy"] = "fsdp2"
    optimizer = ACTOR_OPTIMIZERS[backend](lr=1e-3) if role == "actor" else OptimizerConfig()
    engine = EngineRegistry.new(
        model_type="language_model",
        backend=backend,
        model_config=HFModelConfig(path=path, load_tokenizer=False),
        engine_config=ENGINE_CONFIGS[backend](forward_only=role == "ref", **kwargs),
        optimizer_config=optimizer,
        checkpoint_config=None,
    )
    engine.initialize()
    return engine


def _infer(engine, data) -> torch.Tensor:
    """This data-parallel rank's response-token log-probs, gathered over the data-parallel ranks."""
    local = rank_slice(data, engine.get_data_parallel_rank(), engine.get_data_parallel_size())
    tu.assign_non_tensor(local, use_dynamic_bsz=False, micro_batch_size_per_gpu=len(local))
    with engine.eval_mode():
        out = engine.infer_batch(local)["model_output"]["log_probs"]
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, (engine.get_data_parallel_rank(), list(out.unbind())))
    return dict(pieces)


def _reference_role(rank: int, world_size: int, path: str, ep: int) -> None:
    data = make_batch(BATCH, PROMPT, RESPONSE, seed=7)
    with torch.no_grad():
        expected, _ = reference_log_probs(vm.from_pretrained(path), data)
    expected = expected.unbind()
    for backend, overrides in (("fsdp2", {}), ("veomni", {"expert_parallel_size": ep})):
        ref = _build(path, backend, "ref", **overrides)
        assert ref.optimizer is None and ref.lr_scheduler is None, backend
        actor = _build(path, backend, "actor", **overrides)
        assert actor.optimizer is not None, backend
        ref_out, actor_out = _infer(ref, data), _infer(actor, data)
        for dp_rank, rows in ref_out.items():
            n_dp = ref.get_data_parallel_size()
            for i, (got, from_actor) in enumerate(zip(rows, actor_out[dp_rank])):
                index = dp_rank * (BATCH // n_dp) + i
                # a sequence's last entry predicts the next packed sequence's token: never read by verl
                want = expected[index][:-1]
                assert (got[:-1] - want).abs().max().item() <= 1e-5, (backend, index)
                assert torch.equal(got[:-1], from_actor[:-1]), (backend, index)


@pytest.fixture
def world_of_one():
    """A gloo process group of this process alone (no fresh interpreter: ~3 s instead of ~30 s)."""
    from dist import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_reference_engine_with_plain_optimizer_config(tmp_path, world_of_one):
    _reference_role(0, 1, write_tiny_model(str(tmp_path / "model")), ep=1)


@pytest.mark.dist
@pytest.mark.slow
def test_reference_engine_with_plain_optimizer_config_expert_parallel(tmp_path):
    spawn(_reference_role, 2, write_tiny_model(str(tmp_path / "model")), 2)


def test_trainable_veomni_engine_refuses_plain_optimizer_config(tmp_path):
    path = write_tiny_model(str(tmp_path / "model"))
    with pytest.raises(ValueError, match="needs VeOmniOptimizerConfig"):
        MoeVeOmniEngine(
            HFModelConfig(path=path, load_tokenizer=False), MoeVeOmniEngineConfig(), OptimizerConfig(), None
        )


def test_vision_language_checkpoint_on_text_batches(tmp_path, world_of_one):
    """A Qwen3.5-MoE vision-language checkpoint (real Qwen3.5-35B-A3B folders are): both engines build
    the whole model, tower included (`model.visual.*`, sharded as its own units), and text batches
    give plain autograd's log-probs of its text decoder (`model.language_model.*`) alone; the
    rollout export keeps the checkpoint's names, which our text-only rollout loads."""
    from engine_setup import tiny_config
    from transformers import Qwen3_5MoeConfig
    from verl_moe.engines.rollout.weights import load_named_tensors

    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
                  temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=16)  # fmt: skip
    torch.manual_seed(0)
    config = Qwen3_5MoeConfig(text_config=tiny_config().to_dict(), vision_config=vision)
    vl = vm.build(config)
    assert isinstance(vl, vm.MoeVisionLM)
    path = str(tmp_path / "vl")
    vm.save_pretrained(vl, path)
    data = make_batch(BATCH, PROMPT, RESPONSE, seed=3)
    text_decoder = vm.from_pretrained(path, text_only=True)
    with torch.no_grad():
        expected, _ = reference_log_probs(text_decoder, data)
    for backend in ("fsdp2", "veomni"):
        engine = _build(path, backend, "ref")
        assert any(".visual.blocks.0." in name for name, _ in engine.module.named_parameters()), backend
        for i, got in enumerate(_infer(engine, data)[0]):
            assert (got[:-1] - expected.unbind()[i][:-1]).abs().max().item() <= 1e-5, (backend, i)
        rollout = vm.build(config, text_only=True)
        load_named_tensors(rollout, engine.get_per_tensor_param()[0])
        for name, tensor in text_decoder.state_dict().items():
            assert torch.equal(rollout.state_dict()[name], tensor), (backend, name)
        # text_only: the decoder alone, the same log-probs
        engine = _build(path, backend, "ref", text_only=True)
        assert not any(".visual." in name for name, _ in engine.module.named_parameters()), backend
        for i, got in enumerate(_infer(engine, data)[0]):
            assert (got[:-1] - expected.unbind()[i][:-1]).abs().max().item() <= 1e-5, (backend, "text_only", i)
