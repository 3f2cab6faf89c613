"""Tied word embeddings (lm_head.weight is embed_tokens.weight) in both engines on 2 gloo ranks: a tiny
Qwen3-MoE with tie_word_embeddings=True against single-process plain autograd through the same spec.

Cases, one spawn: fsdp2 sharded over both ranks, fsdp2 hybrid shard (fsdp_size=1: two replicas),
veomni with expert parallelism (EP=2), fsdp2 with Ulysses SP=2. Each: one GRPO step in two
micro-batches; every gradient equals plain autograd's, the tied weight's being the sum of its two
uses' (an untied copy with the same values, one backward: embedding gradient + lm_head gradient);
the weight stays one parameter, in the optimizer once; loss, grad norm and weights after the step
equal a plain AdamW step of the tied spec. fsdp2 also: checkpoint save + resume continues bitwise,
and the HF export holds the embedding once, loads back tied with the saved weights, and loads into
transformers' tied Qwen3MoeForCausalLM with the engine's log-probs. A layout that splits the pair
over two FSDP units is refused.

Tolerances (fp32 everywhere), as tests/engines/test_fsdp2.py: loss, grad norm relative 1e-5;
gradients rel RMS 1e-5 (measured <= 7e-7). The weights after the step are compared with a plain AdamW step
applied to the engine's own gradients (rel RMS 1e-6: the same elementwise update), not with the reference's
weights: Adam's first step moves each entry by lr * g / (|g| + eps), whose slope is up to 1/eps = 1e8 for
entries with |g| near eps, so fp32 reduction-order noise in such a gradient (which a different CPU's
kernels change) moves the weight by up to 2 * lr there, however small the gradients' relative error is.
Log-probs vs transformers max abs 1e-4 (tests/models/test_qwen3_moe.py's logits bound).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import verl_moe.models as vm
from dist import spawn
from engine_setup import (
    build_engine,
    build_veomni_engine,
    grpo_actor_config,
    make_batch,
    ppo_loss_fn,
    rank_slice,
    reference_log_probs,
    reference_train_step,
    with_ppo_fields,
    write_tiny_model,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import Qwen3MoeConfig
from verl.trainer.config import CheckpointConfig
from verl.utils import tensordict_utils as tu
from verl_moe.models.fsdp_plan import check_tied_embeddings
from verl_moe.ops.compare import assert_rel_rms

pytestmark = pytest.mark.dist

BATCH, PROMPT, RESPONSE = 8, 5, 6
EMBED = "model.embed_tokens.weight"


def tied_config() -> Qwen3MoeConfig:
    """2 attention layers (the second dense), 4 experts top-2, lm_head tied to the embeddings."""
    return Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], rms_norm_eps=1e-6, pad_token_id=0, tie_word_embeddings=True,
        architectures=["Qwen3MoeForCausalLM"], rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _tied_module(engine):
    model = engine.module.model
    return model, model.lm_head.weight is model.model.embed_tokens.weight


def _weights(engine) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in engine.get_per_tensor_param(layout="hf")[0]}


def _reference(path: str, data):
    """(loss, grad norm) of one plain-autograd AdamW step on the tied spec, the tied weight's gradient as the
    sum of its two uses (from an untied copy with the same values), and the weights before the step."""
    untied = vm.from_pretrained(path)
    untied.lm_head.weight = torch.nn.Parameter(untied.model.embed_tokens.weight.detach().clone())
    loss_fn = ppo_loss_fn(grpo_actor_config())
    batch = data.clone()
    tu.assign_non_tensor(batch, dp_size=1, batch_num_tokens=int(batch["loss_mask"].sum()), global_batch_size=BATCH)
    loss, _ = loss_fn(model_output={"log_probs": reference_log_probs(untied, batch)[0]}, data=batch, dp_group=None)
    loss.backward()
    grads = {name: p.grad for name, p in untied.named_parameters() if name != "lm_head.weight"}
    embed_use, head_use = untied.model.embed_tokens.weight.grad, untied.lm_head.weight.grad
    grads[EMBED] = embed_use + head_use
    # both uses matter: either alone is far from the sum
    for use in (embed_use, head_use):
        assert (use - (embed_use + head_use)).norm() > 0.1 * (embed_use + head_use).norm()

    tied = vm.from_pretrained(path)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    optimizer = torch.optim.AdamW(tied.parameters(), lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999))
    before = {name: t.detach().clone() for name, t in tied.state_dict().items()}
    ref_loss, ref_norm = reference_train_step(tied, optimizer, data.clone(), loss_fn, clip_grad=1.0)
    return ref_loss, ref_norm, grads, before


def _adamw_step(before: dict, grads: dict, grad_norm: float, clip: float) -> dict:
    """Weights after one plain AdamW step (the reference's settings) from `before` with `grads` clipped by
    `grad_norm` as the engine clips."""
    params = {name: torch.nn.Parameter(before[name].clone()) for name in grads}
    coef = min(1.0, clip / (grad_norm + 1e-6))
    for name, p in params.items():
        p.grad = grads[name] * coef
    torch.optim.AdamW(params.values(), lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999)).step()
    return {name: p.detach() for name, p in params.items()}


def _step_and_compare(engine, data, reference, rank: int, world_size: int) -> None:
    ref_loss, ref_norm, ref_grads, before = reference
    model, tied = _tied_module(engine)
    assert tied
    dp, dp_rank = engine.get_data_parallel_size(), engine.get_data_parallel_rank()
    local = rank_slice(data, dp_rank, dp)
    tu.assign_non_tensor(local, global_batch_size=BATCH, use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    with engine.train_mode():
        engine.optimizer_zero_grad()
        out = engine.forward_backward_batch(local, ppo_loss_fn(grpo_actor_config()))
        named = dict(model.named_parameters())
        assert named.keys() == ref_grads.keys()  # one entry for the tied weight
        # a copy: on a replicated mesh full_tensor() is the local gradient itself, which the step scales in place
        grads = {name: param.grad.full_tensor().clone() for name, param in named.items()}
        for name, g in grads.items():
            assert_rel_rms(f"gradient of {name}", ref_grads[name], g, 1e-5)
        grad_norm = engine.optimizer_step()
    loss = torch.tensor(sum(out["loss"]))
    dist.all_reduce(loss, group=engine.get_data_parallel_group())
    assert _rel(loss.item() / dp, ref_loss) < 1e-5, (loss.item() / dp, ref_loss)
    assert _rel(grad_norm, ref_norm) < 1e-5, (grad_norm, ref_norm)
    model, tied = _tied_module(engine)
    assert tied, "the step untied lm_head from embed_tokens"
    params = {id(p) for p in model.parameters()}
    stepped = [id(p) for group in engine.optimizer.param_groups for p in group["params"]]
    assert sorted(stepped) == sorted(params), "the optimizer must hold each model parameter once"
    weights = _weights(engine)
    assert EMBED in weights and "lm_head.weight" not in weights
    assert weights.keys() == grads.keys()
    expected = _adamw_step(before, grads, grad_norm, clip=1.0)
    for name, tensor in weights.items():
        assert_rel_rms(name, expected[name], tensor, 1e-6)
        assert not torch.equal(tensor, before[name]), f"{name} did not move"


def _checkpoint_config() -> CheckpointConfig:
    return CheckpointConfig(
        save_contents=["model", "optimizer", "extra", "hf_model"], load_contents=["model", "optimizer", "extra"]
    )


def _train(engine, seed: int, rank: int, world_size: int) -> None:
    data = make_batch(BATCH, PROMPT, RESPONSE, seed=seed)
    data["old_log_probs"] = torch.full(data["responses"].shape, -4.5)
    data["ref_log_prob"] = torch.full(data["responses"].shape, -4.6)
    local = rank_slice(data, rank, world_size)
    tu.assign_non_tensor(local, global_batch_size=BATCH, use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    with engine.train_mode():
        engine.train_batch(local, ppo_loss_fn(grpo_actor_config()))


def _checkpoint_and_export(engine, path: str, folder: str, rank: int, world_size: int) -> None:
    """Save, train on; a fresh engine resumed from the save trains on to the same bits. The HF export
    holds the embedding once; transformers' tied model on it gives the engine's log-probs."""
    from safetensors import safe_open
    from transformers import Qwen3MoeForCausalLM

    saved = _weights(engine)
    engine.save_checkpoint(folder, global_step=1)
    data = make_batch(BATCH, PROMPT, RESPONSE, seed=7)
    local = rank_slice(data, rank, world_size)
    tu.assign_non_tensor(local, use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    with engine.eval_mode():
        saved_lp = engine.infer_batch(local)["model_output"]["log_probs"]
    _train(engine, 11, rank, world_size)
    expected = _weights(engine)

    resumed = build_engine(path, checkpoint_config=_checkpoint_config())
    resumed.load_checkpoint(folder)
    assert _tied_module(resumed)[1], "loading a checkpoint untied lm_head from embed_tokens"
    _train(resumed, 11, rank, world_size)
    got = _weights(resumed)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name

    hf_dir = os.path.join(folder, "huggingface")
    names = []
    for file in {f for f in os.listdir(hf_dir) if f.endswith(".safetensors")}:
        with safe_open(os.path.join(hf_dir, file), "pt") as f:
            names += list(f.keys())
    assert EMBED in names and not any(n.startswith("lm_head") for n in names), names
    ours = vm.from_pretrained(hf_dir)  # the round trip: tied again, the saved weights
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    exported = ours.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(tensor, exported[name]), name
    hf = Qwen3MoeForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32, attn_implementation="eager").eval()
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    with torch.no_grad():
        for i, ids in enumerate(local["input_ids"].unbind()):
            logits = hf(input_ids=ids[None], position_ids=local["position_ids"].unbind()[i][None]).logits[0]
            hf_lp = torch.log_softmax(logits.float(), -1)[:-1].gather(-1, ids[1:, None])[:, 0]
            diff = (saved_lp.unbind()[i][:-1] - hf_lp).abs().max().item()
            assert diff <= 1e-4, (i, diff)


def _split_pair_is_refused(world_size: int) -> None:
    """A layout that gives embed_tokens its own FSDP unit, or a model whose tie broke, is refused."""
    mesh = init_device_mesh("cpu", (world_size,))
    model = vm.build(tied_config(), device="meta")
    check_tied_embeddings(model)
    fully_shard(model.model.embed_tokens, mesh=mesh)  # a unit of its own re-points embed_tokens alone
    with pytest.raises(ValueError, match="one FSDP unit"):
        check_tied_embeddings(model)
    untied = vm.build(tied_config(), device="meta")
    untied.lm_head.weight = torch.nn.Parameter(torch.empty_like(untied.lm_head.weight))
    with pytest.raises(ValueError, match="no longer embed_tokens.weight"):
        check_tied_embeddings(untied)


def _tied_two_ranks(rank: int, world_size: int, path: str, folder: str) -> None:
    _split_pair_is_refused(world_size)
    data = make_batch(BATCH, PROMPT, RESPONSE, seed=3)
    with torch.no_grad():
        data = with_ppo_fields(data, reference_log_probs(vm.from_pretrained(path), data)[0], seed=4)
    reference = _reference(path, data)
    for engine in (
        build_engine(path, checkpoint_config=_checkpoint_config()),
        build_engine(path, fsdp_size=1),
        build_veomni_engine(path, expert_parallel_size=2),
        build_engine(path, ulysses_sequence_parallel_size=2),
    ):
        _step_and_compare(engine, data, reference, rank, world_size)
        layout = engine.layout
        if layout.fsdp_size == -1 and layout.expert_parallel_size == 1 and layout.sequence_parallel_size == 1:
            _checkpoint_and_export(engine, path, folder, rank, world_size)


def test_tied_embeddings_two_ranks(tmp_path):
    path = write_tiny_model(str(tmp_path / "model"), config=tied_config())
    spawn(_tied_two_ranks, 2, path, str(tmp_path / "ckpt"))
