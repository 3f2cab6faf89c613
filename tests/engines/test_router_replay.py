"""Router replay (verl's `engine.router_replay.mode` R2 / R3, `engines/router_replay.py`).

- The replayed combine weights and the gradients they give the router (and the input) equal an fp64
  reference: softmax over all experts gathered at the forced ids, renormalised.
- One model, one process: replaying the recorded ids is bitwise free routing; after a router
  perturbation that flips free routing (> 0 % of (token, layer) sets), the experts replay gets are
  exactly the recorded ones (0 % flips) and the router gets a gradient.
- MoeFsdp2Engine, 2 gloo ranks, Ulysses SP=2, 2 micro-batches, R2: infer_batch returns the free
  routing of plain autograd per sequence as verl's nested `routed_experts`; after perturbing the
  router, a training forward on the recorded ids routes exactly them (0 % flips, free: > 0 %), its
  log-probs and router gradient equal plain autograd with the ids forced.
- MoeVeOmniEngine, 2 gloo ranks, expert parallelism 2, R3: a synthetic rollout `routed_experts`
  packed by verl's own `left_right_2_no_padding` (zeros at the padding and at each last token, as
  verl's agent loop leaves them) gives plain autograd's forced-id log-probs; bad routed_experts
  (missing, wrong [L, TOPK], ids out of range, wrong lengths) are ValueErrors naming the shapes.
- verl's own VeOmniEngineConfig / FSDPEngineConfig with `router_replay.mode` pass our checks.
- `verl-moe align` backends `name:replay=R2|R3` (in-process fp64 references): every step routes
  exactly the θ0 routes, where the free golden has left them by step 1.

Tolerances (fp32): log-probs rel RMS 1e-5; router gradient rel RMS 1e-4; fp32 vs fp64 block 1e-5.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
import verl_moe.models as vm
from dist import spawn
from engine_setup import (
    build_engine,
    build_veomni_engine,
    fixed_ppo_batch,
    grpo_actor_config,
    make_batch,
    ppo_loss_fn,
    rank_slice,
    tiny_config,
    write_tiny_model,
)
from torch.distributed.tensor import DTensor, distribute_tensor
from verl import DataProto
from verl.utils import tensordict_utils as tu
from verl.workers.config import EngineRouterReplayConfig
from verl.workers.utils.padding import left_right_2_no_padding
from verl_moe.engines import batch
from verl_moe.engines.router_replay import RECORD, REPLAY, RouterReplay
from verl_moe.models.layers import Experts
from verl_moe.ops.compare import assert_rel_rms
from verl_moe.ops.logprob.reference import logprobs_from_logits_ref
from verl_moe.tools.align.data import rollout_batch
from verl_moe.tools.align.metrics import router_flip_rate

LAYERS, TOPK, EXPERTS = 3, 2, 4  # tiny_config()


def _flips(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of (token, layer) whose expert set differs, for [T, L, TOPK] ids."""
    return router_flip_rate(list(a.long().unbind(1)), list(b.long().unbind(1)))


def _perturb_routers(model: torch.nn.Module, seed: int) -> None:
    """Every router weight += its std times fixed noise (sharded or not: the same full values)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            with torch.no_grad():
                full = p.full_tensor() if isinstance(p, DTensor) else p
                new = full + full.std() * torch.randn(full.shape, generator=gen, dtype=full.dtype)
                p.copy_(distribute_tensor(new, p.device_mesh, p.placements) if isinstance(p, DTensor) else new)


@contextmanager
def _expert_calls(model: torch.nn.Module):
    """Yields the list of (module, topk_idx, in_backward) of every `Experts` call, in call order
    (forward pre-hooks; in_backward: activation checkpointing's recomputation)."""
    calls: list = []

    def hook(module, args):
        calls.append((module, args[1].detach().clone(), torch._C._current_graph_task_id() != -1))

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, Experts)]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def _forward_ids(calls: list) -> list[torch.Tensor]:
    """The forward calls' ids; every recomputation must have got its module's last forward ids."""
    last, forward = {}, []
    for module, ids, in_backward in calls:
        if in_backward:
            assert torch.equal(ids, last[module]), "recomputation routed differently from its forward"
        else:
            last[module] = ids
            forward.append(ids)
    return forward


def _router_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    grads = [p.grad for name, p in model.named_parameters() if name.endswith("mlp.gate.weight")]
    return [g.full_tensor() if isinstance(g, DTensor) else g for g in grads]


def _scored(log_probs: torch.Tensor) -> torch.Tensor:
    """The values of nested [N, j] log-probs without each sequence's last entry (its label is the next
    sequence's first token in a packed row, its own first token in the reference: never read by verl)."""
    keep = torch.ones(log_probs.values().shape[0], dtype=torch.bool)
    keep[log_probs.offsets()[1:] - 1] = False
    return log_probs.values()[keep]


def _valid_rows(ids: torch.Tensor) -> torch.Tensor:
    """[..., 1] True where the TOPK ids are distinct (a row with a repeated id is routed freely)."""
    return (ids.sort(dim=-1).values.diff(dim=-1) != 0).all(dim=-1, keepdim=True)


def _per_sequence(model, data, routed=None):
    """Plain autograd, one sequence at a time: (log-prob [N, j] nested, free expert ids [N, j, L, TOPK]
    nested). With `routed` (nested [N, j, L, TOPK]) each layer's ids are forced to it (rows with a
    repeated id stay free) through a test-owned override."""
    gates = [layer.mlp.gate for layer in model.model.layers]
    log_probs, ids_out = [], []
    for i, ids in enumerate(data["input_ids"].unbind()):
        pos = data["position_ids"].unbind()[i]
        if routed is not None:
            rows = routed.unbind()[i].long()
            for layer, gate in enumerate(gates):
                t = rows[:, layer]
                gate.override = lambda free, t=t: torch.where(_valid_rows(t), t, free)
        with _expert_calls(model) as calls:
            hidden = model(ids[None], pos[None]).last_hidden_state[0]
        ids_out.append(torch.stack(_forward_ids(calls), dim=1))
        labels = torch.cat([ids[1:], ids[:1]])
        log_probs.append(logprobs_from_logits_ref(model.logits(hidden).float(), labels, 1.0)[0])
    for gate in gates:
        gate.override = None
    offsets = data["input_ids"].offsets()
    nested = torch.nested.nested_tensor_from_jagged
    return nested(torch.cat(log_probs), offsets), nested(torch.cat(ids_out), offsets)


# ---- the model hook ---------------------------------------------------------------------------


@pytest.mark.parametrize("router", ["torch", "triton"])  # triton: the kernel's logits and their backward
def test_replayed_weights_and_gradients_equal_fp64_reference(router):
    torch.manual_seed(0)
    block = vm.build(tiny_config(), ops=vm.OpsConfig(router=router)).model.layers[0].mlp
    x = torch.randn(12, 32, requires_grad=True)
    forced = torch.stack([torch.randperm(EXPERTS)[:TOPK] for _ in range(12)])
    block.gate.override = lambda free: forced
    out = block(x[None])[0][0]
    grad_out = torch.randn_like(out)
    (out * grad_out).sum().backward()

    ref = copy.deepcopy(block).double()
    ref.gate.override = None
    x64 = x.detach().double().requires_grad_()
    weight = torch.softmax(x64 @ ref.gate.weight.T, dim=-1).gather(-1, forced)
    if ref.gate.norm_topk_prob:
        weight = weight / weight.sum(dim=-1, keepdim=True)
    expected = ref.experts(x64, forced, weight) + torch.sigmoid(ref.shared_expert_gate(x64)) * ref.shared_expert(x64)
    (expected * grad_out.double()).sum().backward()
    assert_rel_rms("output", expected, out, 1e-5)
    assert_rel_rms("d router weight", ref.gate.weight.grad, block.gate.weight.grad, 1e-5)
    assert_rel_rms("d hidden", x64.grad, x.grad, 1e-5)


def test_replay_pins_expert_ids_under_a_router_perturbation():
    torch.manual_seed(0)
    model = vm.build(tiny_config())
    replay = RouterReplay(model)
    data = make_batch(4, 5, 4, seed=1)
    packed = batch.pack_micro_batch(data, torch.device("cpu"))

    def forward(action: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        with replay.armed(action, data, packed, None):
            hidden = model(packed.input_ids, packed.position_ids, cu_seqlens=packed.cu_seqlens).last_hidden_state
            recorded = replay.recorded(packed, None) if action == RECORD else None
        return hidden, recorded

    with torch.no_grad():
        free = model(packed.input_ids, packed.position_ids, cu_seqlens=packed.cu_seqlens).last_hidden_state
        hidden, recorded = forward(RECORD)
        assert torch.equal(hidden, free) and recorded.values().dtype == torch.int16
        assert recorded.values().shape == (packed.num_tokens, LAYERS, TOPK)
        data["routed_experts"] = recorded
        assert torch.equal(forward(REPLAY)[0], free)  # replaying the free choice is free routing, bitwise
    _perturb_routers(model, seed=3)
    with torch.no_grad():
        _, perturbed = forward(RECORD)
    assert _flips(perturbed.values(), recorded.values()) > 0
    with _expert_calls(model) as calls:
        hidden, _ = forward(REPLAY)
    used = torch.stack(_forward_ids(calls), dim=1)
    assert _flips(used, recorded.values()) == 0 and torch.equal(used, recorded.values().long())
    hidden.square().sum().backward()
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in _router_grads(model))
    assert all(gate.override is not None for gate in (layer.mlp.gate for layer in model.model.layers))
    assert all(slot.targets is None and not slot.recording for slot in replay.slots)  # disarmed on exit


# ---- engines ----------------------------------------------------------------------------------


def _r2_fsdp2_sp(rank: int, world_size: int, path: str) -> None:
    # activation checkpointing on (verl's default): the recomputation in backward must replay too
    engine = build_engine(path, ulysses_sequence_parallel_size=2, router_replay=EngineRouterReplayConfig(mode="R2"))
    reference = vm.from_pretrained(path)
    data = fixed_ppo_batch(4, 5, 4, seed=5, rank=0, world_size=1)  # SP=2: both ranks hold the batch
    tu.assign_non_tensor(data, enable_routing_replay=True)  # as verl's compute_log_prob / update_actor
    with engine.eval_mode():
        recorded = engine.infer_batch(data.clone())["model_output"]["routed_experts"]
    _, free_ids = _per_sequence(reference, data)
    assert recorded.values().dtype == torch.int16
    assert torch.equal(recorded.offsets(), data["input_ids"].offsets())
    assert torch.equal(recorded.values().long(), free_ids.values())

    _perturb_routers(engine.module.model, seed=7)
    _perturb_routers(reference, seed=7)
    with engine.eval_mode():
        perturbed = engine.infer_batch(data.clone())["model_output"]["routed_experts"]
    assert _flips(perturbed.values(), recorded.values()) > 0

    data["routed_experts"] = recorded
    tu.assign_non_tensor(data, return_model_output=True)
    loss_fn = ppo_loss_fn(grpo_actor_config())
    with engine.train_mode(), _expert_calls(engine.module.model) as calls:
        out = engine.forward_backward_batch(data.clone(), loss_fn, forward_only=False)
        grads = _router_grads(engine.module.model)
    assert any(in_backward for _, _, in_backward in calls)
    # per micro-batch (sequences 0-1, 2-3) one forward call per layer on each rank's half of the padded row
    forward, offsets, used = _forward_ids(calls), data["input_ids"].offsets().tolist(), []
    for micro in range(2):
        local = torch.stack(forward[micro * LAYERS : (micro + 1) * LAYERS], dim=1)
        halves = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(halves, local)
        used.append(torch.cat(halves)[: offsets[2 * micro + 2] - offsets[2 * micro]])
    used = torch.cat(used)
    assert _flips(used, recorded.values()) == 0 and torch.equal(used, recorded.values().long())

    log_probs, _ = _per_sequence(reference, data, routed=recorded)
    assert_rel_rms("replayed log-probs", _scored(log_probs), _scored(out["model_output"]["log_probs"]), 1e-5)
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(data["loss_mask"].sum()))
    loss, _ = loss_fn(model_output={"log_probs": log_probs}, data=data, dp_group=None)
    loss.backward()
    for expected, got in zip(_router_grads(reference), grads, strict=True):
        assert got.abs().sum() > 0
        assert_rel_rms("router gradient", expected, got, 1e-4)


@pytest.mark.dist
def test_r2_records_in_infer_and_replays_in_training_fsdp2_sp(tmp_path):
    spawn(_r2_fsdp2_sp, 2, write_tiny_model(str(tmp_path / "model")))


def _rollout_batch_with_routes(batch_size: int, prompt: int, response: int, seed: int):
    """A verl rollout batch whose `routed_experts` [B, S, L, TOPK] (int16, distinct random ids at the
    valid positions, zeros at the padding and at each sequence's last token) is converted by verl's
    `left_right_2_no_padding`, as verl's trainer feeds R3."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 96, (batch_size, prompt + response), generator=gen)
    prompt_valid = torch.randint(1, prompt + 1, (batch_size,), generator=gen)
    response_valid = torch.randint(1, response + 1, (batch_size,), generator=gen)
    rollout = rollout_batch(ids[:, :prompt], ids[:, prompt:], prompt_valid, response_valid)
    mask = rollout["attention_mask"].bool()
    scores = torch.rand(batch_size, prompt + response, LAYERS, EXPERTS, generator=gen)
    routed = scores.argsort(dim=-1)[..., :TOPK].to(torch.int16)
    last = prompt + response_valid - 1  # right-padded responses: the last valid column
    routed[torch.arange(batch_size), last] = 0
    routed[~mask] = 0
    data = DataProto.from_single_dict(
        {
            "input_ids": rollout["input_ids"],
            **rollout,
            "routed_experts": routed,
            "advantages": torch.randn(batch_size, 1, generator=gen).expand(-1, response) * rollout["response_mask"],
        },
        meta_info={"temperature": 1.0},
    )
    return left_right_2_no_padding(data.to_tensordict())


def _expect_value_error(engine, data, *needles: str) -> None:
    with pytest.raises(ValueError) as err, engine.eval_mode():
        engine.infer_batch(data)
    assert all(n in str(err.value) for n in needles), str(err.value)


def _r3_veomni_ep(rank: int, world_size: int, path: str) -> None:
    engine = build_veomni_engine(path, expert_parallel_size=2, router_replay=EngineRouterReplayConfig(mode="R3"))
    data = _rollout_batch_with_routes(4, 5, 4, seed=11)
    routed = data["routed_experts"]
    assert routed.is_nested and routed.values().shape[1:] == (LAYERS, TOPK)
    local = rank_slice(data, rank, world_size)
    with engine.eval_mode():
        log_probs = engine.infer_batch(local.clone())["model_output"]["log_probs"]
    reference = vm.from_pretrained(path)
    expected, _ = _per_sequence(reference, local, routed=local["routed_experts"])
    assert_rel_rms("R3 log-probs", _scored(expected), _scored(log_probs), 1e-5)
    free, _ = _per_sequence(reference, local)
    with pytest.raises(AssertionError):  # the replayed routes matter: free routing fails the same check
        assert_rel_rms("free log-probs", _scored(free), _scored(log_probs), 1e-5)

    no_routes = local.clone()
    del no_routes["routed_experts"]
    _expect_value_error(engine, no_routes, "routed_experts", "R3")
    offsets = local["routed_experts"].offsets()
    values = local["routed_experts"].values()
    nested = torch.nested.nested_tensor_from_jagged
    wrong_layers = local.clone()
    wrong_layers["routed_experts"] = nested(values[:, :2].contiguous(), offsets)
    _expect_value_error(engine, wrong_layers, "(2, 2)", f"({LAYERS}, {TOPK})")
    out_of_range = local.clone()
    out_of_range["routed_experts"] = nested(values + EXPERTS, offsets)
    _expect_value_error(engine, out_of_range, "outside [0, E=4)")
    lengths = offsets.diff().tolist()
    short = local.clone()
    short["routed_experts"] = nested(values[2:].contiguous(), offsets - torch.tensor([0] + [2] * len(lengths)))
    _expect_value_error(engine, short, "rows per sequence", str(lengths))


@pytest.mark.dist
def test_r3_replays_the_rollout_routes_veomni_ep(tmp_path):
    spawn(_r3_veomni_ep, 2, write_tiny_model(str(tmp_path / "model")))


def test_verl_engine_configs_with_router_replay_pass_our_checks(tmp_path):
    from transformers import Qwen3_5MoeTextConfig
    from verl.workers.config import FSDPEngineConfig, HFModelConfig, VeOmniEngineConfig
    from verl_moe.engines.config import validate_engine_config

    model_config = HFModelConfig(path=write_tiny_model(str(tmp_path / "model")), load_tokenizer=False)
    for mode in ("R2", "R3"):
        replay = EngineRouterReplayConfig(mode=mode)
        validate_engine_config(model_config, VeOmniEngineConfig(router_replay=replay), world_size=1)
        validate_engine_config(model_config, FSDPEngineConfig(strategy="fsdp2", router_replay=replay), world_size=1)
    top1 = tiny_config().to_dict() | {"num_experts_per_tok": 1}
    model_config.hf_config = Qwen3_5MoeTextConfig(**top1)
    with pytest.raises(ValueError, match="num_experts_per_tok >= 2"):
        validate_engine_config(model_config, VeOmniEngineConfig(router_replay=EngineRouterReplayConfig(mode="R3")), 1)


# ---- verl-moe align --router-replay -------------------------------------------------------------


def test_align_router_replay_pins_the_theta0_routes(tmp_path):
    """In-process fp64 references (tiny preset, 2 steps): R3 routes every step exactly as the stream's
    fp64 θ0 routed_experts (laid out as verl's agent loop does), R2 exactly as its own θ0 forward (the
    same model: the same routes), and at step 0 both are bitwise the free golden."""
    from verl_moe.tools import align
    from verl_moe.tools.align.trace import load_trace

    backends = ("reference", "reference:replay=R2", "reference:replay=R3")
    report = align.run(align.AlignConfig(backends=backends, steps=2, out=str(tmp_path), progress=False))
    traces = {}
    for label in backends:
        traces[label] = load_trace(tmp_path / "traces" / f"{label.replace(':', '_').replace('=', '-')}.pt")
    stream = torch.load(tmp_path / "stream.pt", weights_only=True)
    for k, rollout in enumerate(stream):
        routes = rollout["routed_experts"][rollout["attention_mask"].bool()].long().sort(dim=-1).values  # [T, L, K]
        for label in backends[1:]:
            topk = traces[label].steps[k].topk
            assert len(topk) == routes.shape[1] and all(torch.equal(t, routes[:, i]) for i, t in enumerate(topk))
    pairs = {p["b"]: p for p in report["pairs"] if p["a"] == "reference"}
    for label in backends[1:]:
        assert traces[label].settings["router_replay"] == label[-2:]
        assert torch.equal(traces[label].steps[0].log_probs, traces["reference"].steps[0].log_probs), label
        # the golden's free routing at step 1 (θ1) left the θ0 routes: pinning them is measurable
        assert pairs[label]["curves"][0]["router_flip_rate"] == 0 < pairs[label]["curves"][1]["router_flip_rate"]
