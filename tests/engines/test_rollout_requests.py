"""Our rollout's per-request behaviour, Ray-free: every sampled request draws from a stream of its own
(keyed by the rollout seed, the weights version and the request), so its tokens do not depend on
arrival order or batch company; and a bad request fails alone, when it arrives.

References: a request's tokens are checked against draws of its own generator from the trainer-side
distribution (one full forward per token). Sampling from logits that differ in the last bits (a
batched decode vs a full forward) picks another token only when a draw lands within ~1e-7 of a
boundary between two tokens, so tokens are compared exactly (fixed seeds: the test is deterministic).
Log-probs are compared bitwise only where the same operations run (one request at a time).
"""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

import pytest
import torch
import verl_moe.models as vm
from engine_setup import VOCAB, tiny_config, tiny_model
from test_rollout import PROMPTS, _adapter, _full_logprobs, _model, _rollout_config
from verl_moe.engines.rollout.adapter import MoeRolloutAdapter
from verl_moe.engines.rollout.engine import GenerationEngine, Request
from verl_moe.engines.rollout.sampling import SamplingParams, stream_seed, stream_uniform
from verl_moe.engines.rollout.server import LocalEngineClient, MoeRolloutServer

SAMPLED = SamplingParams(max_tokens=5, temperature=1.0)
GREEDY = {"temperature": 0, "logprobs": True}
# GRPO sends n copies of a prompt: PROMPTS[0] three times
COPIES = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[0]]


def _broad_model() -> vm.MoeCausalLM:
    """Random tiny model: near-uniform next-token distributions, so different streams draw differently."""
    return tiny_model(seed=0).eval()


def _reference(model, prompt, n, stream, temperature=1.0) -> list[int]:
    """n tokens of `stream`: token t is the first whose fp64 CDF of softmax(logits / T), from a full
    forward of the prompt and the tokens before it, exceeds stream_uniform(stream, t)."""
    tokens: list[int] = []
    for t in range(n):
        ids = torch.tensor([list(prompt) + tokens])
        with torch.no_grad():
            logits = model.logits(model(ids, torch.arange(ids.shape[1])[None]).last_hidden_state)[0, -1]
        cdf = torch.softmax(logits.double() / temperature, -1).cumsum(0)
        tokens.append(int((cdf > stream_uniform(stream, t) * cdf[-1]).nonzero()[0]))
    return tokens


def _tokens(completions) -> dict[str, list[int]]:
    return {c.request_id: c.token_ids for c in completions}


def _generate(engine: GenerationEngine, requests, split: int | None = None) -> dict[str, list[int]]:
    """All of `requests`; with `split`, the first `split` decode 2 tokens before the others join."""
    if split is None:
        return _tokens(engine.generate(requests))
    done = engine.add(requests[:split]) + engine.step(2) + engine.add(requests[split:])
    while engine.num_running:
        done += engine.step(1)
    return _tokens(done)


# ---- sampling streams ------------------------------------------------------------------------


def test_unseeded_request_draws_its_own_stream():
    """Each request's tokens are its own stream's draws, the stream being stream_seed(seed, weights
    version, prompt, sample_key / rank among identical requests)."""
    model = _broad_model()
    requests = [Request(f"r{i}", p, SAMPLED) for i, p in enumerate(COPIES)]
    out = _generate(GenerationEngine(model, [], seed=7, weights_version=3), requests)
    copies: dict[tuple, int] = {}
    for r in requests:
        rank = copies[r.prompt_ids] = copies.get(r.prompt_ids, -1) + 1
        stream = stream_seed(7, 3, r.prompt_ids, f"/{rank}")
        assert out[r.request_id] == _reference(model, r.prompt_ids, SAMPLED.max_tokens, stream), r.request_id
    assert len({tuple(out[f"r{i}"]) for i in (0, 2, 4)}) == 3  # the copies of one prompt differ


def test_tokens_do_not_depend_on_order_or_batch():
    model = _broad_model()
    requests = [Request(f"r{i}", p, SAMPLED) for i, p in enumerate(COPIES)]
    engine = lambda: GenerationEngine(model, [], seed=7, weights_version=3)  # noqa: E731
    base = _generate(engine(), requests)
    distinct = ("r1", "r3")
    copies = ("r0", "r2", "r4")
    for other in (
        _generate(engine(), requests[::-1]),
        _generate(engine(), requests[::-1], split=2),  # the last two decode before the others arrive
        {**_generate(engine(), requests[1:2]), **_generate(engine(), requests[3:4])},  # alone
    ):
        assert all(other[i] == base[i] for i in distinct if i in other)
        # identical requests: the same set of outputs, handed out by arrival rank
        assert sorted(other[i] for i in copies if i in other) in ([], sorted(base[i] for i in copies))
    # a sample_key per copy (a stable id, as under verl's full_determinism) fixes which copy gets which
    keyed = [Request(r.request_id, r.prompt_ids, SAMPLED, sample_key=r.request_id) for r in requests]
    base = _generate(engine(), keyed)
    assert _generate(engine(), keyed[::-1], split=3) == base


def test_weights_version_and_seed_change_every_stream():
    model = _broad_model()
    requests = [Request(f"r{i}", p, SAMPLED) for i, p in enumerate(COPIES)]
    base = _generate(GenerationEngine(model, [], seed=7, weights_version=3), requests)
    for seed, version in ((7, 4), (8, 3)):
        other = _generate(GenerationEngine(model, [], seed=seed, weights_version=version), requests)
        assert all(other[i] != base[i] for i in base), (seed, version)


def test_explicit_seed_is_honoured():
    model = _broad_model()
    seeded = Request("s", PROMPTS[1], SamplingParams(max_tokens=5, temperature=0.8, seed=123))
    alone = _generate(GenerationEngine(model, [], seed=0, weights_version=1), [seeded])["s"]
    others = [Request(f"o{i}", p, SAMPLED) for i, p in enumerate(COPIES)]
    batched = _generate(GenerationEngine(model, [], seed=5, weights_version=9), [*others, seeded], split=3)["s"]
    reference = _reference(model, PROMPTS[1], 5, 123, temperature=0.8)
    assert alone == batched == reference


def test_adapter_keys_streams_by_training_step():
    """update_weights(global_steps) sets the weights version: the same weights at another step draw
    other tokens, at the same step (a resumed run) the same ones."""
    model = _broad_model()
    adapter = _adapter(_rollout_config(seed=11))
    requests = [Request(f"r{i}", p, SAMPLED) for i, p in enumerate(COPIES)]

    def at_step(step):
        asyncio.run(adapter.update_weights(vm.to_vllm_named_tensors(model), global_steps=step))
        return _tokens(adapter.engine_run(requests, SAMPLED.max_tokens)["completions"])

    first, second, again = at_step(3), at_step(4), at_step(3)
    assert again == first
    assert all(second[i] != first[i] for i in first)
    asyncio.run(adapter.update_weights(vm.to_vllm_named_tensors(model)))  # no step given: counts updates
    assert adapter.weights_version == 4


def _server(config, model_config=None):
    adapter = _adapter(config) if model_config is None else MoeRolloutAdapter(config, model_config, replica_rank=0)
    return adapter, MoeRolloutServer(config, engine=LocalEngineClient(adapter))


def test_full_determinism_keys_streams_by_request_id_and_decodes_alone():
    """verl's full_determinism sends ids stable across runs ("det-<batch position>"): each request's
    tokens and log-probs are then the same in any arrival order, bitwise (requests decode one at a
    time, so each runs the same operations)."""
    model = _broad_model()
    adapter, server = _server(_rollout_config(full_determinism=True))
    params = {"temperature": 1.0, "logprobs": True}

    async def run(order, stagger):
        await adapter.update_weights(vm.to_vllm_named_tensors(model), global_steps=1)
        tasks = {}
        for i in order:
            tasks[i] = asyncio.create_task(server.generate(list(COPIES[i]), dict(params), f"det-{i}"))
            if stagger:
                await asyncio.sleep(0.005)
        return {i: await t for i, t in tasks.items()}

    first = asyncio.run(run(range(len(COPIES)), stagger=False))
    second = asyncio.run(run(reversed(range(len(COPIES))), stagger=True))
    for i, out in first.items():
        assert (out.token_ids, out.log_probs) == (second[i].token_ids, second[i].log_probs), i
    assert len({tuple(first[i].token_ids) for i in (0, 2, 4)}) == 3


# ---- bad requests ----------------------------------------------------------------------------


def _one_line_error(coroutine, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        asyncio.run(coroutine)
    assert "\n" not in str(info.value)


def _limited_server(max_positions: int, **config):
    hf_config = tiny_config()
    hf_config.max_position_embeddings = max_positions
    model_config = SimpleNamespace(hf_config=hf_config, generation_config=None, tokenizer=None)
    return _server(_rollout_config(**config), model_config)[1]


def test_server_refuses_bad_requests_when_they_arrive():
    """Refused before any engine call (no weights are loaded: the engine would fail anything), each error
    naming the setting or limit a user changes."""
    server = _limited_server(12, prompt_length=16, response_length=5)  # max_model_len 21 > 12 positions
    bad_max_tokens = "sampling parameter max_tokens must be >= 1, got"
    _one_line_error(server.generate([1, 2], {"max_tokens": 0}, "a"), f"{bad_max_tokens} 0")
    _one_line_error(server.generate([1, 2], {"max_tokens": -3}, "b"), f"{bad_max_tokens} -3")
    _one_line_error(server.generate([], {}, "c"), "prompt is empty")
    vocabulary = rf"outside the model's vocabulary \[0, vocab_size={VOCAB}\)"
    _one_line_error(server.generate([1, VOCAB], {}, "d"), rf"token id {VOCAB} is {vocabulary}")
    _one_line_error(server.generate([-1, 2], {}, "e"), rf"token id -1 is {vocabulary}")
    too_long = "13 tokens is longer than the model's max_position_embeddings=12"
    _one_line_error(server.generate([1] * 13, {}, "f"), too_long)
    no_room = "prompt of 12 tokens leaves no room to generate within 12 tokens: "
    _one_line_error(server.generate([1] * 12, {}, "g"), re.escape(f"{no_room}the model's max_position_embeddings=12"))
    temperature = "sampling parameter temperature must be >= 0, got -1.0 (actor_rollout_ref.rollout.temperature"
    _one_line_error(server.generate([1, 2], {"temperature": -1}, "h"), re.escape(temperature))
    _one_line_error(server.generate([1, 2], {"top_p": 0}, "i"), re.escape("top_p must be in (0, 1], got 0.0 (actor_"))
    _one_line_error(server.generate([1, 2], {"best_of": 2}, "j"), r"\['best_of'\] not supported .*; it takes \[")


@pytest.mark.parametrize(
    ("config", "setting"),
    [
        ({}, "data.max_prompt_length=16 + data.max_response_length=5 (actor_rollout_ref.rollout.max_model_len unset)"),
        ({"max_model_len": 9}, "actor_rollout_ref.rollout.max_model_len=9"),
    ],
)
def test_no_room_names_the_setting_of_the_context(config, setting):
    """The context is min(max_model_len, the model's positions); max_model_len defaults to verl's prompt +
    response lengths, which verl's rollout config takes from `data.max_prompt_length` / `max_response_length`."""
    server = _limited_server(64, prompt_length=16, response_length=5, **config)
    context = config.get("max_model_len", 21)
    message = f"prompt of {context} tokens leaves no room to generate within {context} tokens: {setting}"
    _one_line_error(server.generate([1] * context, {}, "a"), re.escape(message))


def test_engine_add_refuses_bad_requests_and_admits_nothing():
    model = _model()
    params = SamplingParams(max_tokens=6, temperature=0)
    alone = GenerationEngine(model, []).generate([Request("a", PROMPTS[0], params)])[0].token_ids
    engine = GenerationEngine(model, [], max_positions=6)
    engine.add([Request("a", PROMPTS[0], params)])
    bad = {
        "twice": [Request("b", PROMPTS[1], params), Request("b", PROMPTS[1], params)],
        "already running": [Request("a", PROMPTS[1], params)],
        "outside the model's vocabulary": [Request("c", PROMPTS[1], params), Request("d", (VOCAB,), params)],
        "prompt is empty": [Request("e", (), params)],
        "max_position_embeddings=6": [Request("f", PROMPTS[2], params)],  # 7 tokens
    }
    for match, requests in bad.items():
        with pytest.raises(ValueError, match=match):
            engine.add(requests)
        assert engine.num_running == 1, match
    done = []
    while engine.num_running:
        done += engine.step(1)
    assert [c.token_ids for c in done] == [alone]


def test_bad_engine_and_rollout_settings_are_refused_naming_them():
    from verl_moe.engines.rollout.config import RolloutOptions, rollout_dtype

    model = _model()
    for key, kwargs in (
        ("actor_rollout_ref.rollout.max_num_seqs", {"max_num_seqs": 0}),
        ("actor_rollout_ref.rollout.engine_kwargs.verl_moe.sync_every", {"sync_every": 0}),
        ("actor_rollout_ref.rollout.engine_kwargs.verl_moe.max_prefill_tokens", {"max_prefill_tokens": 0}),
    ):
        with pytest.raises(ValueError, match=re.escape(f"{key} must be >= 1, got 0")):
            GenerationEngine(model, [], **kwargs)
    with pytest.raises(ValueError, match=re.escape("actor_rollout_ref.rollout.engine_kwargs.verl_moe.steps_per_call")):
        RolloutOptions(steps_per_call=0)
    with pytest.raises(ValueError, match=re.escape("actor_rollout_ref.rollout.dtype='int8' is not one of")):
        rollout_dtype("int8")


def test_bad_request_during_decode_fails_alone():
    """A request with a token id outside the vocabulary arrives while another decodes: it gets its own
    error, the other completes with the greedy tokens of the full forward, and sleep() then works."""
    model = _model()
    config = _rollout_config(response_length=12)  # steps_per_call 2: several engine calls
    adapter, server = _server(config)

    async def scenario():
        await adapter.update_weights(vm.to_vllm_named_tensors(model), global_steps=1)
        good = asyncio.create_task(server.generate(list(PROMPTS[0]), dict(GREEDY), "good"))
        while adapter._engine.num_running == 0:
            await asyncio.sleep(0)
        errors = []
        for prompt, params in (([3, VOCAB + 5], GREEDY), ([3, 4], {**GREEDY, "max_tokens": 0})):
            try:
                await server.generate(prompt, dict(params), "bad")
            except ValueError as e:
                errors.append(str(e))
        running_then = adapter._engine.num_running
        out = await good
        await server.sleep()
        return errors, running_then, out

    errors, running_then, out = asyncio.run(scenario())
    assert running_then == 1  # the good request was still decoding when the bad ones were refused
    assert "outside the model's vocabulary" in errors[0] and "max_tokens" in errors[1]
    _, argmax = _full_logprobs(model, PROMPTS[0], out.token_ids)
    assert out.stop_reason == "completed" and len(out.token_ids) == 12 and out.token_ids == argmax.tolist()
    assert adapter._model is None  # slept


def test_failed_engine_call_fails_its_requests_only_and_frees_the_engine():
    """An engine call that raises (an internal fault) fails the requests it was running; the engine
    drops their sequences, so later requests are served and sleep() works."""
    model = _model()
    adapter, server = _server(_rollout_config(response_length=8))

    async def scenario():
        await adapter.update_weights(vm.to_vllm_named_tensors(model), global_steps=1)
        engine, step = adapter._engine, adapter._engine.step

        def fail_once(steps=1):
            engine.step = step
            raise RuntimeError("injected fault")

        engine.step = fail_once
        with pytest.raises(RuntimeError, match="injected fault"):
            await server.generate(list(PROMPTS[0]), dict(GREEDY), "first")
        after = await server.generate(list(PROMPTS[1]), dict(GREEDY), "after")
        await server.sleep()
        return after

    after = asyncio.run(scenario())
    _, argmax = _full_logprobs(model, PROMPTS[1], after.token_ids)
    assert after.stop_reason == "completed" and after.token_ids == argmax.tolist()
    assert adapter._model is None
