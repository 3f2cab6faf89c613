"""verl's critic (role `value_model`) on our engines against transformers' value model of the same weights.

The critic loads a value checkpoint (a tiny Qwen3.5-MoE's decoder plus a `score` head with a non-zero bias,
`models/value_head.py`; once a tiny Qwen3-MoE's); the reference is transformers' Qwen3.5-MoE decoder
(`AutoModel`) plus a Linear(D, 1) head holding the same tensors (for Qwen3-MoE transformers' own
`Qwen3MoeForTokenClassification`), run one sequence at a time (transformers' torch GatedDeltaNet ignores
packing), trained by plain autograd with verl's own `value_loss` (clipped, token-mean) over the whole batch,
then AdamW as the engine's optimizer.

- through our engines on 2 gloo ranks (`fsdp2` with 2 data-parallel ranks and with one Ulysses SP group of 2,
  and `veomni` with the experts split over both ranks): the values of every token, the gradient of every
  parameter (gathered in full) and the weights after the step, which the checkpoint's HF export holds as a
  value checkpoint;
- through verl's own `TrainingWorker` on Ray, built with the critic's config (as verl's trainer builds its
  critic): `infer_batch` values, `train_mini_batch` loss, grad norm and vf_loss, and the values after it.

Tolerances (fp32): values max abs 1e-5; loss, vf_loss and grad norm relative 1e-5; gradients rel (L2) 1e-4
per parameter; weights after the step rel RMS 1e-5; values after the step max abs 1e-4 (Adam divides by
sqrt(v): entries with tiny gradients amplify reduction-order noise).
"""

from __future__ import annotations

from functools import partial

import pytest
import ray
import torch
from dist import spawn
from engine_setup import make_batch, rank_slice, tiny_model
from hf_value_model import hf_value_model, hf_values
from torch.distributed.tensor import DTensor
from transformers import AutoConfig
from verl.utils import tensordict_utils as tu
from verl.utils.metric import reduce_metrics
from verl.workers.utils.losses import value_loss
from verl.workers.utils.padding import no_padding_2_padding
from verl_moe.models.value_head import add_value_head, save_value_pretrained
from verl_moe.ops.compare import assert_rel_rms
from verl_moe.tools.align.backends.engine import engine_configs

BATCH, PROMPT, RESPONSE = 8, 5, 6
LR = 1e-3


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def write_value_model(path: str, config=None) -> str:
    """A value checkpoint: `tiny_model(config)`'s decoder (default the tiny Qwen3.5-MoE) and a drawn head whose
    bias is not 0."""
    model = tiny_model(config)
    add_value_head(model, torch.Generator().manual_seed(11))
    with torch.no_grad():
        model.score.bias.fill_(0.3)
    save_value_pretrained(model, path)
    return path


def critic_config():
    """verl's critic config as the trainer's value loss reads it: value clipping at 0.2, token-mean."""
    from verl.workers.config import FSDPCriticConfig

    return FSDPCriticConfig(
        strategy="fsdp2", ppo_mini_batch_size=BATCH, ppo_micro_batch_size_per_gpu=2, cliprange_value=0.2,
        loss_agg_mode="token-mean", rollout_n=1,
    )  # fmt: skip


def critic_batch(seed: int):
    """A rollout batch in the engines' format with what verl's critic update reads: old `values` and
    `returns` [N, R] (the old values near the model's, so value clipping acts on part of the tokens)."""
    data = make_batch(BATCH, PROMPT, RESPONSE, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    mask = data["response_mask"].float()
    data["values"] = (0.3 + 0.2 * torch.randn(mask.shape, generator=gen)) * mask
    data["returns"] = torch.randn(mask.shape, generator=gen) * mask
    return data


def reference_values(model, data) -> torch.Tensor:
    """transformers' values of every token, one sequence at a time: nested [N, j]."""
    ids, pos = data["input_ids"].unbind(), data["position_ids"].unbind()
    out = [hf_values(model, i[None], p[None])[0] for i, p in zip(ids, pos)]
    return torch.nested.nested_tensor_from_jagged(torch.cat(out), data["input_ids"].offsets())


def reference_step(model, optimizer, data) -> tuple[float, float, dict, dict]:
    """verl's value loss over the whole batch (one micro-batch, dp 1), clip to 1.0, AdamW: (loss, grad norm
    before clipping, the loss's metrics, every parameter's gradient before clipping)."""
    optimizer.zero_grad()
    data = data.clone()
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(data["loss_mask"].sum()), global_batch_size=BATCH)
    loss, metrics = value_loss(critic_config(), {"values": reference_values(model, data)}, data)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item(), grad_norm.item(), metrics, grads


def _reference(path: str):
    from verl_moe.models.value_head import value_from_pretrained

    ours = value_from_pretrained(path, AutoConfig.from_pretrained(path), seed=0)
    model = hf_value_model(ours.config, ours.state_dict())
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, betas=(0.9, 0.999))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _engine_vs_transformers(rank: int, world_size: int, path: str, backend: str, sp: int, ckpt_dir: str) -> None:
    from verl.trainer.config import CheckpointConfig
    from verl.workers.engine import EngineRegistry

    engine = dict(use_dynamic_bsz=False, micro_batch_size_per_gpu=2, infer_micro_batch_size_per_gpu=2)
    if backend == "veomni":
        engine |= dict(mixed_precision=True, param_dtype="fp32", expert_parallel_size=2)
    else:
        engine |= dict(
            strategy="fsdp2",
            mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32"},
            ulysses_sequence_parallel_size=sp,
        )
    model_config, engine_config, optimizer_config = engine_configs(
        backend, path, engine, {"lr": LR}, {"model_type": "value_model"}
    )
    critic = EngineRegistry.new(
        model_type="value_model", backend=engine_config.strategy, model_config=model_config,
        engine_config=engine_config, optimizer_config=optimizer_config,
        checkpoint_config=CheckpointConfig(save_contents=["model", "optimizer", "extra", "hf_model"]),
    )  # fmt: skip
    critic.initialize()
    reference, optimizer = _reference(path)
    data = critic_batch(seed=3)
    dp = world_size // sp  # the ranks of an SP group share one slice
    local = rank_slice(data, rank // sp, dp)

    with critic.eval_mode():
        out = critic.infer_batch(local.clone())
    with torch.no_grad():
        ref = reference_values(reference, local)
    got = out["model_output"]["values"]
    assert got.offsets().tolist() == ref.offsets().tolist()
    assert (got.values() - ref.values()).abs().max().item() <= 1e-5

    ref_loss, ref_norm, _, ref_grads = reference_step(reference, optimizer, data)
    tu.assign_non_tensor(local, global_batch_size=BATCH)
    with critic.train_mode():
        critic.optimizer_zero_grad()
        result = critic.forward_backward_batch(local, partial(value_loss, critic_config()), forward_only=False)
        grads = {name: _full(p.grad) for name, p in critic.module.model.named_parameters()}
        grad_norm = critic.optimizer_step()
    loss = torch.tensor(sum(result["loss"]))
    torch.distributed.all_reduce(loss)  # TrainingWorker reports the dp-average of per-rank sums (SP ranks agree)
    assert _rel(loss.item() / world_size, ref_loss) < 1e-5, (loss.item() / world_size, ref_loss)
    assert _rel(grad_norm, ref_norm) < 1e-5, (grad_norm, ref_norm)
    assert set(grads) == set(ref_grads)
    for name, grad in grads.items():
        ref_grad = ref_grads[name]
        assert (grad - ref_grad).norm() <= 1e-4 * ref_grad.norm() + 1e-12, name
    ref_state = reference.state_dict()
    trained = dict(critic.get_per_tensor_param(layout="hf")[0])
    for name, tensor in trained.items():
        assert_rel_rms(name, ref_state[name], tensor, 1e-5)

    # the checkpoint's HF export is a value checkpoint: the trained weights, head included
    critic.save_checkpoint(ckpt_dir, global_step=1)
    if rank == 0:
        from verl_moe.models.value_head import value_from_pretrained

        exported = value_from_pretrained(f"{ckpt_dir}/huggingface", AutoConfig.from_pretrained(path), seed=0)
        exported = exported.state_dict()
        assert exported.keys() == trained.keys()
        for name, tensor in trained.items():
            assert torch.equal(exported[name], tensor), name


@pytest.mark.dist
@pytest.mark.parametrize(
    ("backend", "sp", "family"),
    [("fsdp2", 1, "qwen3_5_moe"), ("fsdp2", 2, "qwen3_5_moe"), ("veomni", 1, "qwen3_5_moe"), ("fsdp2", 1, "qwen3_moe")],
    ids=["fsdp2_dp2", "fsdp2_sp2", "veomni_ep2", "qwen3_moe_fsdp2_dp2"],
)
def test_critic_engine_matches_transformers(tmp_path, backend, sp, family):
    """Qwen3-MoE's reference is transformers' own Qwen3MoeForTokenClassification (num_labels=1)."""
    from tiny_models import tiny_qwen3_moe

    path = write_value_model(str(tmp_path / "critic"), tiny_qwen3_moe() if family == "qwen3_moe" else None)
    spawn(_engine_vs_transformers, 2, path, backend, sp, str(tmp_path / "checkpoint"))


@pytest.fixture
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.dist
def test_verls_critic_worker_runs_our_engine(tmp_path, ray_cluster):
    """verl's TrainingWorker built as verl's trainer builds its critic (`TrainingWorkerConfig` with
    model_type `value_model` and the critic's engine, optimizer and checkpoint configs; the loss is
    verl's `value_loss` with the critic config), 2 Ray workers on the fsdp2 engine."""
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig
    from verl_moe.engines.config import MoeFsdp2EngineConfig

    path = write_value_model(str(tmp_path / "critic"))
    config = TrainingWorkerConfig(
        model_type="value_model",
        model_config=HFModelConfig(path=path, load_tokenizer=False),
        engine_config=MoeFsdp2EngineConfig(
            mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32"},
            use_dynamic_bsz=True,
            max_token_len_per_gpu=24,
            infer_max_token_len_per_gpu=30,
        ),
        optimizer_config=FSDPOptimizerConfig(lr=LR),
        checkpoint_config=CheckpointConfig(),
    )
    workers = RayWorkerGroup(
        resource_pool=RayResourcePool(process_on_nodes=[2]),
        ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(TrainingWorker), config=config),
    )
    workers.reset()
    workers.set_loss_fn(partial(value_loss, config=critic_config()))
    reference, optimizer = _reference(path)
    data = critic_batch(seed=5)

    def infer_and_compare(tolerance: float) -> None:
        batch = data.clone()
        tu.assign_non_tensor(batch, compute_loss=False)
        got = no_padding_2_padding(tu.get(workers.infer_batch(batch).get(), "values"), data)
        with torch.no_grad():
            ref = no_padding_2_padding(reference_values(reference, data), data)
        diff = (got - ref).abs() * data["response_mask"]
        assert diff.max().item() <= tolerance, diff.max().item()

    infer_and_compare(1e-5)
    ref_loss, ref_norm, ref_metrics, _ = reference_step(reference, optimizer, data)
    batch = data.clone()
    tu.assign_non_tensor(
        batch, global_batch_size=BATCH, mini_batch_size=BATCH, epochs=1, seed=1, dataloader_kwargs={"shuffle": False}
    )
    metrics = tu.get(workers.train_mini_batch(batch).get(), "metrics")
    assert _rel(metrics["loss"][0], ref_loss) < 1e-5, (metrics["loss"], ref_loss)
    assert _rel(metrics["grad_norm"][0], ref_norm) < 1e-5, (metrics["grad_norm"], ref_norm)
    # reduced as verl's trainer reduces the critic's metrics before logging them
    vf_loss = reduce_metrics({"vf_loss": metrics["critic/vf_loss"]})["vf_loss"]
    assert _rel(vf_loss, ref_metrics["critic/vf_loss"].aggregate()) < 1e-5, (metrics["critic/vf_loss"], ref_metrics)
    assert 0 < ref_metrics["critic/vf_clipfrac"] < 1  # value clipping took part of the tokens
    infer_and_compare(1e-4)  # after one AdamW step on both sides


def test_critic_refusals_name_the_key():
    from types import SimpleNamespace

    from verl_moe.engines.value_model import check_value_model_config, is_value_role

    def configs(lora_rank=0, mtp=False, replay="disabled"):
        model = SimpleNamespace(model_type="value_model", lora_rank=lora_rank, mtp=SimpleNamespace(enable=mtp))
        return model, SimpleNamespace(router_replay=SimpleNamespace(mode=replay))

    assert is_value_role(configs()[0])
    check_value_model_config(*configs())
    for kwargs, message in [
        (dict(lora_rank=8), "critic.model.lora_rank=8"),
        (dict(mtp=True), "critic.model.mtp.enable=true"),
        (dict(replay="R3"), "router_replay.mode='R3'"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_value_model_config(*configs(**kwargs))
    with pytest.raises(ValueError, match="must be one of"):
        is_value_role(SimpleNamespace(model_type="reward_model"))
