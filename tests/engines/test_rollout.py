"""Our rollout (`engines/rollout/`), Ray-free: sampling vs an explicit fp64 formula, the weight
stream, the batched engine vs the full forward, and the server's generate / abort / sleep.

Tolerances:
| what                                                        | dtype | tol (max abs) |
| processed log-prob of the sampled token vs explicit formula | fp32  | 1e-5          |
| rollout log-probs vs the trainer-side full forward          | fp32  | 1e-5          |
"""

from __future__ import annotations

import asyncio
import gc
import logging
import re
import weakref
from types import SimpleNamespace

import pytest
import torch
import verl_moe.models as vm
from engine_setup import tiny_config, tiny_model
from verl.workers.config import RolloutConfig
from verl_moe.engines.rollout.adapter import MoeRolloutAdapter
from verl_moe.engines.rollout.engine import GenerationEngine, Request
from verl_moe.engines.rollout.sampling import SamplingParams, sample, stream_uniform
from verl_moe.engines.rollout.server import LocalEngineClient, MoeRolloutServer
from verl_moe.engines.rollout.weights import load_named_tensors

PROMPTS = [(5, 9, 3, 7, 1), (11,), (2, 4, 6, 8, 10, 12, 14)]


def _model(seed: int = 0) -> vm.MoeCausalLM:
    """Tiny Qwen3.5-MoE with random norms and a sharpened lm_head (peaked next-token distributions)."""
    model = tiny_model(seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model.eval()


def _full_logprobs(model, prompt, tokens, temperature=1.0):
    """Trainer-side log-probs: one forward of prompt + tokens, log_softmax(logits / T) at the tokens."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model.logits(model(ids, torch.arange(ids.shape[1])[None]).last_hidden_state)[0].float()
    logits = logits[len(prompt) - 1 : -1]
    lp = (logits / temperature).log_softmax(-1)
    return lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0], logits.argmax(-1)


def _requests(params: SamplingParams, prompts=PROMPTS) -> list[Request]:
    return [Request(f"r{i}", p, params) for i, p in enumerate(prompts)]


# ---- sampling --------------------------------------------------------------------------------


def _explicit_distribution(logits, p: SamplingParams):
    """fp64 probabilities after temperature, top-k, top-p, min-p, token by token."""
    x = logits.double() / (1.0 if p.greedy else p.temperature)
    order = sorted(range(x.numel()), key=lambda i: -x[i].item())
    keep = set(order[: p.top_k] if 0 < p.top_k < x.numel() else order)
    probs = torch.softmax(x.masked_fill(torch.tensor([i not in keep for i in range(x.numel())]), float("-inf")), 0)
    mass, kept = 0.0, set()
    for i in order:
        if i in keep and mass < p.top_p:
            kept.add(i)
            mass += probs[i].item()
    biggest = probs.max().item()
    kept = {i for i in kept if probs[i].item() >= p.min_p * biggest}
    x = x.masked_fill(torch.tensor([i not in kept for i in range(x.numel())]), float("-inf"))
    return torch.softmax(x, 0)


def test_sample_matches_explicit_processed_distribution():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=gen) * 3
    params = [
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=1, temperature=0.7),
        SamplingParams(max_tokens=1, temperature=1.0, top_k=5),
        SamplingParams(max_tokens=1, temperature=1.3, top_p=0.6),
        SamplingParams(max_tokens=1, temperature=0.9, top_k=10, top_p=0.8, min_p=0.05),
    ]
    for seed in range(5):
        tokens, lps = sample(
            logits, params, [None if p.greedy else stream_uniform(seed, n) for n, p in enumerate(params)]
        )
        for n, p in enumerate(params):
            ref = _explicit_distribution(logits[n], p)
            t = tokens[n].item()
            assert ref[t] > 0, f"row {n}: token {t} outside the processed support"
            assert abs(lps[n].item() - ref[t].log().item()) <= 1e-5
        assert tokens[0].item() == logits[0].argmax().item()  # greedy: argmax, log-prob at temperature 1


def test_sample_follows_distribution_and_inverts_the_cdf():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]).expand(4000, -1)
    p = SamplingParams(max_tokens=1, temperature=0.8)
    tokens, _ = sample(logits, [p] * 4000, [stream_uniform(3, i) for i in range(4000)])
    freq = torch.bincount(tokens, minlength=5).double() / 4000
    probs = torch.softmax(logits[0].double() / 0.8, 0)
    assert (freq - probs).abs().max() < 0.03  # 4000 draws: std of a frequency <= 0.008
    # the first token whose CDF exceeds the number, whatever the other rows draw
    cdf = probs.cumsum(0)
    for u in (0.0, 0.3, float(cdf[1]) - 1e-6, float(cdf[1]) + 1e-6, 0.999999):  # fp32 log-probs: 1e-7
        expected = int((cdf > u).nonzero()[0])
        drawn, _ = sample(logits[:3], [p] * 3, [0.5, u, 0.9])
        assert drawn[1].item() == expected, u
    with pytest.raises(ValueError, match="number"):
        sample(logits[:1], [p], [None])


def test_sampling_params_from_verl_request():
    p = SamplingParams.from_request(
        {"temperature": 0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}, max_tokens=8
    )
    assert p.greedy and p.logprobs and p.max_tokens == 8
    assert not SamplingParams.from_request({"logprobs": False}, max_tokens=1).logprobs
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams.from_request({"presence_penalty": 0.5}, max_tokens=8)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(max_tokens=1, top_p=0.0)


# ---- weights ---------------------------------------------------------------------------------


def test_load_named_tensors_vllm_and_hf_layouts():
    source, target = _model(seed=1), vm.build(tiny_config())
    assert load_named_tensors(target, vm.to_vllm_named_tensors(source)) > len(source.state_dict())  # per expert
    for name, t in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], t), name
    other = vm.build(tiny_config())
    load_named_tensors(other, source.state_dict().items())  # transformers names, fused experts
    assert all(torch.equal(other.state_dict()[n], t) for n, t in source.state_dict().items())


def test_load_named_tensors_is_strict():
    source = _model()
    pairs = list(vm.to_vllm_named_tensors(source))
    with pytest.raises(ValueError, match="incomplete"):
        load_named_tensors(vm.build(tiny_config()), [p for p in pairs if ".experts.3.up_proj" not in p[0]])
    with pytest.raises(ValueError, match="not a parameter"):
        load_named_tensors(vm.build(tiny_config()), [*pairs, ("model.layers.0.bogus.weight", torch.zeros(1))])
    name, t = pairs[0]
    with pytest.raises(ValueError, match="shape"):
        load_named_tensors(vm.build(tiny_config()), [(name, t[:-1])])


# ---- engine ----------------------------------------------------------------------------------


def test_engine_greedy_batched_equals_argmax_decoding_and_trainer_logprobs():
    model = _model()
    engine = GenerationEngine(model, eos_token_ids=[])
    out = engine.generate(_requests(SamplingParams(max_tokens=6, temperature=0.0, logprobs=True)))
    for prompt, c in zip(PROMPTS, out):
        assert c.finish_reason == "length" and len(c.token_ids) == 6
        lp_ref, argmax = _full_logprobs(model, prompt, c.token_ids)
        assert c.token_ids == argmax.tolist()
        assert (torch.tensor(c.log_probs) - lp_ref).abs().max().item() <= 1e-5


def test_engine_sampled_logprobs_equal_trainer_logprobs_at_temperature():
    """The rollout/trainer mismatch verl reports (training/rollout_probs_diff_*) on our spec in fp32."""
    model = _model()
    engine = GenerationEngine(model, eos_token_ids=[], seed=5)
    out = engine.generate(_requests(SamplingParams(max_tokens=8, temperature=0.7, logprobs=True)))
    diffs = []
    for prompt, c in zip(PROMPTS, out):
        lp_ref, _ = _full_logprobs(model, prompt, c.token_ids, temperature=0.7)
        diffs.append((torch.tensor(c.log_probs) - lp_ref).abs().max().item())
    assert max(diffs) <= 1e-5, diffs


def test_engine_stops_at_eos_and_respects_ignore_eos():
    model = _model()
    free = GenerationEngine(model, eos_token_ids=[]).generate(_requests(SamplingParams(max_tokens=8, temperature=0)))
    eos = free[0].token_ids[2]
    engine = GenerationEngine(model, eos_token_ids=[eos])
    out = engine.generate(_requests(SamplingParams(max_tokens=8, temperature=0)))
    for ref, c in zip(free, out):
        cut = ref.token_ids.index(eos) + 1 if eos in ref.token_ids else len(ref.token_ids)
        assert c.token_ids == ref.token_ids[:cut]
        assert c.finish_reason == ("stop" if eos in ref.token_ids else "length")
    assert out[0].finish_reason == "stop" and len(out[0].token_ids) <= 3
    kept = engine.generate(_requests(SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))
    assert [c.token_ids for c in kept] == [c.token_ids for c in free]


def test_engine_seeded_sampling_reproducible_alone_or_batched():
    model = _model()
    seeded = SamplingParams(max_tokens=6, temperature=1.0, seed=123)
    alone = GenerationEngine(model, [], seed=0).generate([Request("a", PROMPTS[0], seeded)])[0]
    others = [Request(f"o{i}", p, SamplingParams(max_tokens=4, temperature=1.0)) for i, p in enumerate(PROMPTS)]
    batched = GenerationEngine(model, [], seed=1).generate([*others, Request("a", PROMPTS[0], seeded)])[-1]
    assert alone.token_ids == batched.token_ids
    unseeded = SamplingParams(max_tokens=6, temperature=1.0)
    run = [GenerationEngine(model, [], seed=4).generate(_requests(unseeded)) for _ in range(2)]
    assert [c.token_ids for c in run[0]] == [c.token_ids for c in run[1]]


def test_engine_joining_requests_mid_decode():
    """A request admitted while others decode gets the same tokens as when generated alone."""
    model = _model()
    params = SamplingParams(max_tokens=7, temperature=0)
    alone = {c.request_id: c.token_ids for c in GenerationEngine(model, []).generate(_requests(params))}
    engine = GenerationEngine(model, [])
    reqs = _requests(params)
    done = engine.add(reqs[:2]) + engine.step(3) + engine.add(reqs[2:])
    while engine.num_running:
        done += engine.step(2)
    assert {c.request_id: c.token_ids for c in done} == alone


# ---- adapter + server ------------------------------------------------------------------------


def _rollout_config(**overrides) -> RolloutConfig:
    kwargs = dict(
        name="verl_moe",
        tensor_model_parallel_size=1,
        dtype="float32",
        prompt_length=16,
        response_length=5,
        engine_kwargs={"verl_moe": {"steps_per_call": 2, "batch_wait_ms": 1}},
    )
    kwargs.update(overrides)
    return RolloutConfig(**kwargs)


def _adapter(config: RolloutConfig, eos=None) -> MoeRolloutAdapter:
    model_config = SimpleNamespace(
        hf_config=tiny_config(), generation_config=SimpleNamespace(eos_token_id=eos), tokenizer=None
    )
    return MoeRolloutAdapter(config, model_config, device_mesh=None, replica_rank=0)


def test_server_generate_batched_greedy_follows_weight_updates(caplog):
    caplog.set_level(logging.INFO, logger="verl_moe.engines.rollout")
    model = _model()
    config = _rollout_config()
    adapter = _adapter(config)
    server = MoeRolloutServer(config, engine=LocalEngineClient(adapter))

    updated = _model(seed=1)  # the next step's policy
    greedy = {"temperature": 0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}

    async def generate_all(tag):
        return await asyncio.gather(
            *[server.generate(list(p), dict(greedy), f"{tag}{i}") for i, p in enumerate(PROMPTS)]
        )

    async def scenario():
        await adapter.resume(["weights"])
        await adapter.update_weights(vm.to_vllm_named_tensors(model), global_steps=3)
        first = await generate_all("a")
        sizes = adapter._engine.sizes
        await server.sleep()
        await adapter.resume(["weights"])
        await adapter.update_weights(vm.to_vllm_named_tensors(updated), global_steps=4)
        await adapter.resume(["kv_cache"])  # the new engine's slots as large as the last one's
        assert adapter._engine.sizes == sizes and sizes["slots"] >= len(PROMPTS)
        return first, await generate_all("b")

    results = asyncio.run(scenario())
    waves = [r.getMessage() for r in caplog.records if " engine calls taking " in r.getMessage()]
    generated = [sum(len(out.token_ids) for out in outs) for outs in results]
    # one summary per wave: every request of the wave and every token it generated, and the engine's share
    assert [f"{len(PROMPTS)} requests, {n} tokens in" in w for w, n in zip(waves, generated)] == [True, True]
    for wave in waves:
        wall, engine = (float(x) for x in re.search(r"in ([0-9.]+) s .* taking ([0-9.]+) s", wave).groups())
        assert 0 < engine <= wall
    for policy, step, outs in zip((model, updated), (3, 4), results):
        for prompt, out in zip(PROMPTS, outs):
            assert len(out.token_ids) == config.response_length  # no max_tokens sent: capped at response_length
            assert out.stop_reason == "completed" and out.extra_fields["global_steps"] == step
            lp_ref, argmax = _full_logprobs(policy, prompt, out.token_ids)
            assert out.token_ids == argmax.tolist()
            assert (torch.tensor(out.log_probs) - lp_ref).abs().max().item() <= 1e-5


def test_server_abort_resume_and_sleep(monkeypatch):
    model = _model()
    config = _rollout_config(response_length=12)
    adapter = _adapter(config)
    server = MoeRolloutServer(config, engine=LocalEngineClient(adapter))
    params = {"temperature": 0, "logprobs": False}

    async def scenario():
        await adapter.update_weights(vm.to_vllm_named_tensors(model))
        tasks = [asyncio.create_task(server.generate(list(p), dict(params), f"a{i}")) for i, p in enumerate(PROMPTS)]
        while adapter._engine.num_running == 0:  # until the first engine call has admitted them
            await asyncio.sleep(0)
        aborted = await server.abort_all_requests()
        partial = await asyncio.gather(*tasks)
        parked = asyncio.create_task(server.generate([1, 2], dict(params), "late"))
        await asyncio.sleep(0.01)
        assert not parked.done()  # held behind the closed gate
        await server.resume_generation()
        late = await parked
        await server.abort_all_requests(reject_request=True)
        rejected = await server.generate([1, 2], dict(params), "rejected")
        await server.resume_generation()
        held.extend(weakref.ref(x) for x in (next(adapter._model.parameters()), adapter._engine))
        await server.sleep()
        return aborted, partial, late, rejected

    held, collections = [], []
    monkeypatch.setattr(gc, "collect", lambda *a, **k: collections.append(a))

    aborted, partial, late, rejected = asyncio.run(scenario())
    assert aborted["aborted_count"] == len(PROMPTS)
    assert all(o.stop_reason == "aborted" and 0 < len(o.token_ids) < 12 for o in partial)
    assert late.stop_reason == "completed" and len(late.token_ids) == 12
    assert rejected.stop_reason == "aborted" and rejected.token_ids == []
    assert adapter._model is None  # sleep freed the weights (free_cache_engine)
    # by reference counts alone (no reference cycle holds them): no full garbage collection ran
    assert [ref() for ref in held] == [None, None] and collections == []
    with pytest.raises(ValueError, match="no weights"):
        adapter.engine_run([], 1)


def test_bf16_rollout_holds_the_routers_as_the_trainer_does():
    """The trainer keeps each MoE router in its fp32 master dtype under bf16 mixed precision: a bf16 rollout holds
    the router weights it receives unrounded (else exact mode's routing would differ), every other weight in bf16."""
    from verl_moe.models.layers import TopKRouter

    model = _model()
    model.model.layers[0].mlp.gate.weight.data += 1e-4  # not bf16-representable
    adapter = _adapter(_rollout_config(dtype="bfloat16"))
    asyncio.run(adapter.update_weights(vm.to_vllm_named_tensors(model), global_steps=1))
    sent = dict(model.named_parameters())
    routers = {name for name, m in adapter._model.named_modules() if isinstance(m, TopKRouter)}
    assert routers
    for name, param in adapter._model.named_parameters():
        if name.removesuffix(".weight") in routers:
            assert param.dtype == torch.float32 and torch.equal(param, sent[name]), name
        else:
            assert param.dtype == torch.bfloat16, name


def test_server_refuses_what_it_cannot_do():
    config = _rollout_config()
    server = MoeRolloutServer(config, engine=LocalEngineClient(_adapter(config)))
    with pytest.raises(ValueError, match="text token ids only"):
        asyncio.run(server.generate([1], {}, "x", image_data=[object()]))
    with pytest.raises(ValueError, match="no room"):
        asyncio.run(server.generate(list(range(1, 30)), {}, "y"))
    with pytest.raises(ValueError, match="routed experts"):
        MoeRolloutServer(_rollout_config(enable_rollout_routing_replay=True), engine=object())
    with pytest.raises(ValueError, match="prompt_logprobs"):
        asyncio.run(server.generate([1], {"prompt_logprobs": 1}, "z"))
    with pytest.raises(ValueError, match="unknown key"):
        MoeRolloutServer(_rollout_config(engine_kwargs={"verl_moe": {"steps": 3}}), engine=object())


def test_plugin_registers_the_rollout():
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import RolloutReplicaRegistry
    from verl_moe.engines import plugin
    from verl_moe.engines.rollout.replica import MoeRolloutReplica

    plugin.register_rollout()
    assert get_rollout_class("verl_moe", "async") is MoeRolloutAdapter
    assert RolloutReplicaRegistry.get("verl_moe") is MoeRolloutReplica
