"""MoeVeOmniEngine (VeOmni's parallel state; expert parallelism) against MoeFsdp2Engine on the
same weights and batch, on 2 and 4 gloo ranks: infer log-probs and one GRPO train step.

Cases: EP off (FSDP over both ranks); EP=2 on 2 ranks (each rank holds half the experts, no
expert sharding); EP=2 on 4 ranks (experts split in two and each half sharded over 2 ranks:
the 2-D expert mesh); EP=2 with Ulysses SP=2 on 4 ranks.

Tolerances (fp32 everywhere), as tests/engines/test_sequence_parallel.py: log-probs / entropy
max abs 1e-5; loss, grad norm relative 1e-5; updated weights rel RMS 1e-5 per tensor and the
update itself rel RMS 1e-4.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist import spawn
from engine_setup import (
    build_engine,
    build_veomni_engine,
    check_delta_weight_sync,
    grpo_actor_config,
    make_batch,
    ppo_loss_fn,
    rank_slice,
    with_ppo_fields,
    write_tiny_model,
)
from torch.distributed.tensor import DTensor
from verl.utils import tensordict_utils as tu
from verl_moe.engines.veomni import MoeVeOmniEngine
from verl_moe.ops.compare import assert_rel_rms

pytestmark = pytest.mark.dist

BATCH, PROMPT, RESPONSE = 8, 6, 7


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _full_weights(engine) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in engine.get_per_tensor_param(layout="hf")[0]}


def _step(engine, batch, loss_fn) -> tuple[float, float]:
    """One train step; (dp-averaged loss as verl's TrainingWorker reports it, grad norm)."""
    with engine.train_mode():
        out = engine.train_batch(batch, loss_fn)
    assert out["metrics"]["grad_norm_nonfinite"] == [0.0]
    loss = torch.tensor(sum(out["loss"]))
    dist.all_reduce(loss, group=engine.get_data_parallel_group())
    return loss.item() / engine.get_data_parallel_size(), out["metrics"]["grad_norm"]


def _veomni_equals_fsdp2(rank: int, world_size: int, path: str, ep: int, sp: int) -> None:
    reference = build_engine(path)
    engine = build_veomni_engine(path, expert_parallel_size=ep, ulysses_parallel_size=sp)
    assert isinstance(engine, MoeVeOmniEngine)
    experts = engine.module.model.model.layers[0].mlp.experts
    if ep > 1:
        local = experts.gate_up_proj.to_local() if isinstance(experts.gate_up_proj, DTensor) else None
        assert local is not None and experts.expert_parallel.size == ep
        # each rank keeps its expert block, sharded along dim 1 over the other expert-mesh ranks
        assert local.shape[0] == experts.gate_up_proj.shape[0] // ep
    dp = world_size // sp
    assert engine.get_data_parallel_size() == dp

    data = make_batch(BATCH, PROMPT, RESPONSE, seed=3)
    outputs = []
    for eng, n_dp, dp_rank in ((reference, world_size, rank), (engine, dp, engine.get_data_parallel_rank())):
        batch = rank_slice(data, dp_rank, n_dp)
        tu.assign_non_tensor(batch, calculate_entropy=True, use_dynamic_bsz=False, micro_batch_size_per_gpu=len(batch))
        with eng.eval_mode():
            out = eng.infer_batch(batch)["model_output"]
        # a sequence's last position predicts the next packed sequence's first token: not comparable
        # between different slicings of the batch, and never used by verl
        keep = torch.ones(len(out["log_probs"].values()), dtype=torch.bool)
        keep[out["log_probs"].offsets()[1:] - 1] = False
        gathered = [None] * world_size
        dist.all_gather_object(gathered, (dp_rank, {k: v.values()[keep] for k, v in out.items()}))
        by_dp_rank = dict(gathered)  # SP ranks of one group hold the same outputs
        outputs.append({k: torch.cat([by_dp_rank[r][k] for r in range(n_dp)]) for k in ("log_probs", "entropy")})
    for key in ("log_probs", "entropy"):
        diff = (outputs[1][key] - outputs[0][key]).abs().max().item()
        assert diff <= 1e-5, (key, diff)

    with reference.eval_mode():  # old log-probs from one whole-batch pass, as verl's recompute
        infer = data.clone()
        tu.assign_non_tensor(infer, use_dynamic_bsz=False, micro_batch_size_per_gpu=BATCH)
        data = with_ppo_fields(data, reference.infer_batch(infer)["model_output"]["log_probs"], seed=4)
    loss_fn = ppo_loss_fn(grpo_actor_config())
    before = _full_weights(reference)
    results = []
    for eng, n_dp, dp_rank in ((reference, world_size, rank), (engine, dp, engine.get_data_parallel_rank())):
        batch = rank_slice(data, dp_rank, n_dp)
        tu.assign_non_tensor(batch, global_batch_size=BATCH, use_dynamic_bsz=False, micro_batch_size_per_gpu=1)
        results.append(_step(eng, batch, loss_fn))
    (loss_ref, norm_ref), (loss, norm) = results
    assert _rel(loss, loss_ref) < 1e-5, (loss, loss_ref)
    assert _rel(norm, norm_ref) < 1e-5, (norm, norm_ref)
    reference_weights, weights = _full_weights(reference), _full_weights(engine)
    assert reference_weights.keys() == weights.keys()
    for name, tensor in reference_weights.items():
        assert_rel_rms(name, tensor, weights[name], 1e-5)
        assert_rel_rms(f"update of {name}", tensor - before[name], weights[name] - before[name], 1e-4)


@pytest.mark.parametrize(
    ("world_size", "ep", "sp"),
    [(2, 1, 1), (2, 2, 1), (4, 2, 1), (4, 2, 2)],
    ids=["ep1", "ep2", "ep2_sharded_experts", "ep2_sp2"],
)
def test_veomni_equals_fsdp2(tmp_path, world_size, ep, sp):
    path = write_tiny_model(str(tmp_path / "model"))
    spawn(_veomni_equals_fsdp2, world_size, path, ep, sp)


def _resume_bit_exact_with_ep(rank: int, world_size: int, path: str, ckpt: str) -> None:
    import verl_moe.models as vm
    from test_checkpoint import _train, _weights
    from verl.trainer.config import CheckpointConfig

    contents = ["model", "optimizer", "extra", "hf_model"]
    config = CheckpointConfig(save_contents=contents, load_contents=contents[:3])
    schedule = dict(lr_warmup_steps_ratio=0.2, total_training_steps=10, lr_scheduler_type="cosine")

    def engine():
        return build_veomni_engine(path, optimizer=schedule, checkpoint_config=config, expert_parallel_size=2)

    first = engine()
    _train(first, range(2), rank, world_size)
    first.save_checkpoint(ckpt, global_step=2)
    saved = _weights(first)
    _train(first, range(2, 4), rank, world_size)
    expected = _weights(first)

    second = engine()
    second.load_checkpoint(ckpt)
    for name, tensor in _weights(second).items():
        assert torch.equal(tensor, saved[name]), name
    _train(second, range(2, 4), rank, world_size)
    assert second.lr_scheduler.get_last_lr() == first.lr_scheduler.get_last_lr()
    for name, tensor in _weights(second).items():
        assert torch.equal(tensor, expected[name]), name
    # the HF export holds every expert (gathered over the EP ranks), loadable by the spec
    exported = vm.from_pretrained(f"{ckpt}/huggingface").state_dict()
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name


def test_checkpoint_resume_is_bit_exact_under_expert_parallelism(tmp_path):
    path = write_tiny_model(str(tmp_path / "model"))
    spawn(_resume_bit_exact_with_ep, 2, path, str(tmp_path / "ckpt"))


def _delta_weight_sync_with_ep(rank: int, world_size: int, path: str) -> None:
    engine = build_veomni_engine(path, expert_parallel_size=2)
    check_delta_weight_sync(engine, rank, world_size, BATCH, PROMPT, RESPONSE)


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 4])
def test_delta_weight_sync_with_expert_parallelism(tmp_path, world_size):
    """Expert tensors are DTensors over the expert mesh (ep x FSDP; at 4 ranks FSDP also cuts each
    expert's dim 1, so a rank's block is not one flat range): each rank's delta lands in the right
    per-expert vLLM tensors."""
    path = write_tiny_model(str(tmp_path / "model"))
    spawn(_delta_weight_sync_with_ep, world_size, path)
