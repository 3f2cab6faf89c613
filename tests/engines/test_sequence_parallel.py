"""MoeFsdp2Engine with Ulysses SP=2 (dp=1) against the same engine with SP=1 (dp=2) on 2 gloo
ranks: tiny Qwen3.5-MoE (2 GatedDeltaNet + 1 attention layers) for infer and one train step, tiny
Qwen3-MoE (attention only, 1 kv head) for infer; packed sequences of unequal lengths including
one of a single token, with an odd total (so the SP slice pads).

Tolerances (fp32 everywhere): log-probs / entropy max abs 1e-5; loss, grad norm relative 1e-5;
updated weights rel RMS 1e-5 per tensor, and the update itself (new - old weights) rel RMS 1e-4
(Adam divides by sqrt(v): entries with tiny gradients amplify fp32 reduction-order noise).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import verl_moe.models as vm
from dist import spawn
from engine_setup import (
    VOCAB,
    build_engine,
    grpo_actor_config,
    make_batch,
    ppo_loss_fn,
    rank_slice,
    with_ppo_fields,
    write_tiny_model,
)
from transformers import Qwen3MoeConfig
from verl.utils import tensordict_utils as tu
from verl_moe.ops.compare import assert_rel_rms

BATCH, PROMPT, RESPONSE = 8, 6, 7
# (prompt, response) tokens per sample: sample 1 is a single token; 59 tokens in all
VALID = ([6, 1, 3, 5, 2, 6, 4, 1], [7, 0, 5, 2, 7, 1, 3, 6])


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _full_weights(engine) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in engine.get_per_tensor_param(layout="hf")[0]}


def _sp2_equals_sp1(rank: int, world_size: int, path: str, fsdp_size: int) -> None:
    sp1 = build_engine(path)
    sp2 = build_engine(path, ulysses_sequence_parallel_size=2, fsdp_size=fsdp_size)
    assert (sp1.get_data_parallel_size(), sp1.get_data_parallel_rank(), sp1.is_mp_src_rank_with_outputs()) == (
        2,
        rank,
        True,
    )
    assert (sp2.get_data_parallel_size(), sp2.get_data_parallel_rank(), sp2.is_mp_src_rank_with_outputs()) == (
        1,
        0,
        rank == 0,
    )
    data = make_batch(BATCH, PROMPT, RESPONSE, seed=3, temperature=torch.linspace(0.7, 1.3, BATCH), valid=VALID)
    assert data["input_ids"].offsets()[-1] % 2 == 1 and data["input_ids"].offsets().diff().min() == 1

    # infer: every rank gets the whole batch as one micro-batch (59 tokens: one pad under SP)
    outputs = []
    for engine in (sp1, sp2):
        batch = data.clone()
        tu.assign_non_tensor(batch, calculate_entropy=True, use_dynamic_bsz=False, micro_batch_size_per_gpu=BATCH)
        with engine.eval_mode():
            outputs.append(engine.infer_batch(batch)["model_output"])
    for key in ("log_probs", "entropy"):
        diff = (outputs[1][key].values() - outputs[0][key].values()).abs().max().item()
        assert diff <= 1e-5, (key, diff)

    # train one GRPO step, micro-batches by token budget (per rank; SP=2 holds twice the tokens)
    data = with_ppo_fields(data, outputs[0]["log_probs"], seed=4)
    loss_fn = ppo_loss_fn(grpo_actor_config())
    before = _full_weights(sp1)
    results = []
    for engine, batch in ((sp1, rank_slice(data, rank, world_size)), (sp2, data.clone())):
        tu.assign_non_tensor(batch, global_batch_size=BATCH, use_dynamic_bsz=True, max_token_len_per_gpu=16)
        with engine.train_mode():
            out = engine.train_batch(batch, loss_fn)
        assert out["metrics"]["grad_norm_nonfinite"] == [0.0]
        # TrainingWorker reports the dp-average of each dp rank's sum over micro-batches
        loss = torch.tensor(sum(out["loss"]))
        dist.all_reduce(loss, group=engine.get_data_parallel_group())
        results.append((loss.item() / engine.get_data_parallel_size(), out["metrics"]["grad_norm"]))
    (loss1, norm1), (loss2, norm2) = results
    assert _rel(loss2, loss1) < 1e-5, (loss2, loss1)
    assert _rel(norm2, norm1) < 1e-5, (norm2, norm1)
    weights1, weights2 = _full_weights(sp1), _full_weights(sp2)
    for name, tensor in weights1.items():
        assert_rel_rms(name, tensor, weights2[name], 1e-5)
        assert_rel_rms(f"update of {name}", tensor - before[name], weights2[name] - before[name], 1e-4)


def _qwen3_moe_sp2_infer_equals_sp1(rank: int, world_size: int, path: str) -> None:
    data = make_batch(BATCH, PROMPT, RESPONSE, seed=5, valid=VALID)
    tu.assign_non_tensor(data, calculate_entropy=True, use_dynamic_bsz=False, micro_batch_size_per_gpu=BATCH)
    outputs = []
    for sp in (1, 2):
        engine = build_engine(path, ulysses_sequence_parallel_size=sp)
        with engine.eval_mode():
            outputs.append(engine.infer_batch(data.clone())["model_output"])
    for key in ("log_probs", "entropy"):
        diff = (outputs[1][key].values() - outputs[0][key].values()).abs().max().item()
        assert diff <= 1e-5, (key, diff)


@pytest.mark.dist
@pytest.mark.parametrize("fsdp_size", [-1, 1], ids=["full_shard", "hybrid_shard"])
def test_sp2_equals_sp1(tmp_path, fsdp_size):
    """SP over the whole world with full sharding, and with hybrid sharding (shard groups of one rank,
    replicated across the two): both must equal the plain data-parallel run."""
    path = write_tiny_model(str(tmp_path / "model"))
    spawn(_sp2_equals_sp1, 2, path, fsdp_size)


@pytest.mark.dist
def test_qwen3_moe_sp2_equals_sp1(tmp_path):
    """Attention only, one kv head for two SP ranks (each gets a replicated copy)."""
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-6,
        pad_token_id=0, tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"],
    )  # fmt: skip
    path = str(tmp_path / "qwen3_moe")
    vm.save_pretrained(vm.build(config), path)
    spawn(_qwen3_moe_sp2_infer_equals_sp1, 2, path)
