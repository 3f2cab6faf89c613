"""verl's own TrainingWorker, 2 Ray workers on the cpu platform, running MoeFsdp2Engine and
MoeVeOmniEngine (the latter with the experts split over both workers).

`VERL_PLATFORM=cpu` (tests/engines/conftest.py) reaches the Ray workers through the
environment; verl's unmodified `RayResourcePool(process_on_nodes=[2])` then asks for one CPU
per worker. Checked against plain autograd through the spec in this process: infer log-probs
(max abs 1e-5), and after train_mini_batch the loss and grad norm (relative 1e-5); once with two
data-parallel ranks, once with one Ulysses SP=2 group (verl dispatches the batch by our
data-parallel rank and collects outputs from SP rank 0 only), and once through the veomni backend
with expert parallelism 2 (what `model_engine=veomni` builds).
"""

from __future__ import annotations

import pytest
import ray
import torch
import verl_moe.models as vm
from engine_setup import (
    grpo_actor_config,
    make_batch,
    ppo_loss_fn,
    reference_log_probs,
    reference_train_step,
    with_ppo_fields,
    write_tiny_model,
)
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.trainer.config import CheckpointConfig
from verl.utils import tensordict_utils as tu
from verl.workers.config import FSDPOptimizerConfig, HFModelConfig, VeOmniOptimizerConfig
from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig
from verl.workers.utils.padding import no_padding_2_padding
from verl_moe.engines.config import MoeFsdp2EngineConfig, MoeVeOmniEngineConfig

BATCH, PROMPT, RESPONSE = 8, 5, 6


@pytest.fixture
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "sp"), [("fsdp2", 1), ("fsdp2", 2), ("veomni", 1)], ids=["dp2", "sp2", "veomni_ep2"]
)
def test_training_worker_runs_our_engine(tmp_path, ray_cluster, backend, sp):
    path = write_tiny_model(str(tmp_path / "model"))
    batching = dict(use_dynamic_bsz=True, max_token_len_per_gpu=24, infer_max_token_len_per_gpu=30)
    if backend == "veomni":
        engine_config = MoeVeOmniEngineConfig(expert_parallel_size=2, param_dtype="fp32", **batching)
        optimizer_config = VeOmniOptimizerConfig(lr=1e-3)
    else:
        engine_config = MoeFsdp2EngineConfig(
            ulysses_sequence_parallel_size=sp,
            mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32"},
            **batching,
        )
        optimizer_config = FSDPOptimizerConfig(lr=1e-3)
    config = TrainingWorkerConfig(
        model_type="language_model",
        model_config=HFModelConfig(path=path, load_tokenizer=False),
        engine_config=engine_config,
        optimizer_config=optimizer_config,
        checkpoint_config=CheckpointConfig(),
    )
    workers = RayWorkerGroup(
        resource_pool=RayResourcePool(process_on_nodes=[2]),
        ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(TrainingWorker), config=config),
    )
    workers.reset()
    reference = vm.from_pretrained(path)

    data = make_batch(BATCH, PROMPT, RESPONSE, seed=5, temperature=0.9)
    tu.assign_non_tensor(data, compute_loss=False, calculate_entropy=True)
    out = workers.infer_batch(data).get()
    with torch.no_grad():
        ref_lp, ref_ent = reference_log_probs(reference, data)
    for key, ref in (("log_probs", ref_lp), ("entropy", ref_ent)):
        got = no_padding_2_padding(tu.get(out, key), data)
        diff = (got - no_padding_2_padding(ref, data)).abs() * data["response_mask"]
        assert diff.max().item() <= 1e-5, (key, diff.max().item())

    actor_config = grpo_actor_config()
    data = with_ppo_fields(make_batch(BATCH, PROMPT, RESPONSE, seed=5, temperature=0.9), ref_lp, seed=6)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01)
    ref_loss, ref_norm = reference_train_step(reference, ref_optim, data.clone(), ppo_loss_fn(actor_config), 1.0)

    workers.set_loss_fn(ppo_loss_fn(actor_config))
    tu.assign_non_tensor(
        data, global_batch_size=BATCH, mini_batch_size=BATCH, epochs=1, seed=1, dataloader_kwargs={"shuffle": False}
    )
    metrics = tu.get(workers.train_mini_batch(data).get(), "metrics")
    assert _rel(metrics["loss"][0], ref_loss) < 1e-5, (metrics["loss"], ref_loss)
    assert _rel(metrics["grad_norm"][0], ref_norm) < 1e-5, (metrics["grad_norm"], ref_norm)
    assert metrics["grad_norm_nonfinite"] == [0.0] * (2 // sp)  # one entry per data-parallel rank
