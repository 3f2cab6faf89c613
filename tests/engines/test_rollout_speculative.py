"""Speculative decoding in our rollout (`engine_kwargs.verl_moe.speculative_tokens`, or verl's
`model.mtp.enable_rollout`): the adapter builds `SpeculativeEngine`, and verl's calls through the server
(generate, abort, sleep / wake-up, weight updates) work on it; what it cannot run is refused with one line.

On the tiny fp32 Qwen3.5-MoE with one MTP layer fitted to its own samples (`test_speculative.fitted_model`,
so drafts are both kept and rejected), through `MoeRolloutServer` + `LocalEngineClient`:

- greedy requests give the tokens of the same server with speculation off, their log-probs to 1e-5 (the
  verification runs k + 1 positions through the chunked ops, plain decoding one at a time);
- each response carries its draft counts in extra_fields (verl's `spec_num_*` keys), some drafts kept;
- abort, sleep and wake-up (slots reserved at their old size), a second weight update;
- verl's `main_ppo` (recipe/tiny_cpu, 2 steps) with speculation on through verl's switch (default suite) or
  ours (slow): the runs' checks of `test_main_ppo.py` and verl's `rollout/spec_accept_rate` / `_length` from
  our counts.

Tolerances:
| what                                                   | dtype | tol          |
| log-probs, speculation on vs off (greedy)              | fp32  | 1e-5 max abs |
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
import verl_moe.models as vm
from engine_setup import tiny_config
from test_main_ppo import RUN_TIMEOUT_S, SHORT_STEPS, _check_run, _run_main_ppo, _toy_rl
from test_speculative import PROMPTS, fitted_model
from verl.workers.config import MtpConfig, RolloutConfig
from verl_moe.engines.rollout.adapter import MoeRolloutAdapter
from verl_moe.engines.rollout.config import OPTIONS_KEY, RolloutOptions
from verl_moe.engines.rollout.engine import GenerationEngine
from verl_moe.engines.rollout.routing import SpeculativeWhereItPays
from verl_moe.engines.rollout.server import LocalEngineClient, MoeRolloutServer
from verl_moe.engines.rollout.speculative import SpeculativeEngine

TOL = 1e-5
GREEDY = {"temperature": 0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
SPEC_KEYS = ("spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_num_verify_steps")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's ops are too small to share between threads on a small shared host."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return fitted_model()


def _config(speculative_tokens: int = 0, verl_moe: dict | None = None, **overrides) -> RolloutConfig:
    kwargs = dict(
        name="verl_moe",
        tensor_model_parallel_size=1,
        dtype="float32",
        prompt_length=16,
        response_length=14,
        engine_kwargs={
            "verl_moe": {
                "steps_per_call": 3,
                "batch_wait_ms": 1,
                "speculative_tokens": speculative_tokens,
                **(verl_moe or {}),
            }
        },
    )
    kwargs.update(overrides)
    return RolloutConfig(**kwargs)


def _mtp_config(mtp_layers: int = 1):
    config = tiny_config()
    config.mtp_num_hidden_layers = mtp_layers
    return config


def _adapter(config: RolloutConfig, mtp_layers: int = 1) -> MoeRolloutAdapter:
    model_config = SimpleNamespace(
        hf_config=_mtp_config(mtp_layers), generation_config=SimpleNamespace(eos_token_id=None), tokenizer=None
    )
    return MoeRolloutAdapter(config, model_config, device_mesh=None, replica_rank=0)


def _serve(model, config: RolloutConfig, tag: str, params: dict):
    """A server on a fresh adapter: weights at step 1, PROMPTS generated concurrently, then a sleep, a wake-up
    and a second update with the same weights, PROMPTS again. Returns (adapter, first outputs, second)."""
    adapter = _adapter(config)
    server = MoeRolloutServer(config, engine=LocalEngineClient(adapter))

    async def generate_all(wave):
        return await asyncio.gather(
            *[server.generate(list(p), dict(params), f"{tag}{wave}{i}") for i, p in enumerate(PROMPTS)]
        )

    async def scenario():
        await adapter.update_weights(vm.to_vllm_named_tensors(model), global_steps=1)
        first = await generate_all("a")
        sizes = adapter._engine.sizes
        await server.sleep()
        await adapter.resume(["weights"])
        await adapter.update_weights(vm.to_vllm_named_tensors(model), global_steps=2)
        await adapter.resume(["kv_cache"])
        slots = sizes["speculative"]["slots"] if "speculative" in sizes else sizes["slots"]
        assert adapter._engine.sizes == sizes and slots >= len(PROMPTS)
        return first, await generate_all("b")

    first, second = asyncio.run(scenario())
    return adapter, first, second


def test_greedy_through_the_server_equals_speculation_off(model):
    _, plain, _ = _serve(model, _config(0), "p", GREEDY)
    adapter, first, second = _serve(model, _config(2), "s", GREEDY)
    assert isinstance(adapter._engine, SpeculativeWhereItPays) and adapter._engine.k == 2
    drafted = accepted = 0
    for outs in (first, second):
        for ref, out in zip(plain, outs):
            assert out.token_ids == ref.token_ids and out.stop_reason == "completed"
            assert len(out.token_ids) == 14
            assert max(abs(a - b) for a, b in zip(out.log_probs, ref.log_probs)) <= TOL
            fields = out.extra_fields
            assert all(key in fields for key in SPEC_KEYS), fields
            assert 0 <= fields["spec_num_accepted_tokens"] <= fields["spec_num_draft_tokens"]
            drafted += fields["spec_num_draft_tokens"]
            accepted += fields["spec_num_accepted_tokens"]
    assert 0 < accepted < drafted  # drafts kept and rejected
    assert not any(key in plain[0].extra_fields for key in SPEC_KEYS)


def test_sampled_requests_abort_and_sleep(model):
    """Seeded sampled requests repeat their tokens across two servers; abort returns partial outputs and the
    engine serves again after it; sleep frees the engine."""
    params = {"temperature": 0.9, "logprobs": True, "seed": 5}
    _, first, second = _serve(model, _config(3), "x", params)
    _, again, _ = _serve(model, _config(3), "y", params)
    assert [o.token_ids for o in first] == [o.token_ids for o in second] == [o.token_ids for o in again]

    config = _config(3, response_length=40)
    adapter = _adapter(config)
    server = MoeRolloutServer(config, engine=LocalEngineClient(adapter))

    async def scenario():
        await adapter.update_weights(vm.to_vllm_named_tensors(model), global_steps=1)
        tasks = [asyncio.create_task(server.generate(list(p), dict(GREEDY), f"a{i}")) for i, p in enumerate(PROMPTS)]
        while adapter._engine.num_running == 0:
            await asyncio.sleep(0)
        aborted = await server.abort_all_requests()
        partial = await asyncio.gather(*tasks)
        await server.resume_generation()
        late = await server.generate([1, 2], dict(GREEDY), "late")
        await server.sleep()
        return aborted, partial, late

    aborted, partial, late = asyncio.run(scenario())
    assert aborted["aborted_count"] == len(PROMPTS)
    assert all(o.stop_reason == "aborted" and 0 < len(o.token_ids) < 40 for o in partial)
    assert late.stop_reason == "completed" and len(late.token_ids) == 40
    assert adapter._engine is None and adapter._model is None


def test_engine_calls_the_adapter_makes(model):
    """step(steps) advances every request by at least `steps` tokens (or to its end); reserve, sizes,
    set_weights_version, abort_all and max_num_seqs as `GenerationEngine` has them."""
    from verl_moe.engines.rollout.engine import Request
    from verl_moe.engines.rollout.sampling import SamplingParams

    engine = SpeculativeEngine(model, eos_token_ids=[], num_draft_tokens=2, max_num_seqs=4)
    engine.reserve(slots=3, positions=40)
    assert engine.sizes == {"slots": 3, "positions": 40}
    params = SamplingParams(max_tokens=30, temperature=0.0)
    done = engine.add([Request(f"r{i}", p, params) for i, p in enumerate(PROMPTS[:3])])
    assert not done and engine.sizes == {"slots": 3, "positions": 40}
    before = {s.request.request_id: len(s.tokens) for s in engine._seqs if s is not None}
    engine.step(4)
    after = {s.request.request_id: len(s.tokens) for s in engine._seqs if s is not None}
    assert all(after[r] - before[r] >= 4 for r in after)
    with pytest.raises(ValueError, match="while requests run"):
        engine.set_weights_version(3)
    with pytest.raises(ValueError, match="max_num_seqs=4"):
        engine.add([Request(f"x{i}", (1,), params) for i in range(2)])
    aborted = engine.abort_all()
    assert sorted(c.request_id for c in aborted) == ["r0", "r1", "r2"]
    assert all(c.finish_reason == "abort" and len(c.token_ids) == after[c.request_id] for c in aborted)
    assert engine.num_running == 0 and set(engine.take_request_stats()) == {"r0", "r1", "r2"}
    assert engine.take_request_stats() == {}
    engine.set_weights_version(3)
    assert engine.weights_version == 3
    # after an abort the slots serve again, with the tokens of plain decoding
    request = Request("again", PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0))
    plain = GenerationEngine(model, eos_token_ids=[]).generate([request])
    assert engine.generate([request])[0].token_ids == plain[0].token_ids


def test_speculation_steps_aside_for_many_requests_and_other_sampling(model):
    """`SpeculativeWhereItPays` (max_speculative 2): requests arriving when more than 2 would run decode in the
    plain engine, with plain decoding's tokens and log-probs and no draft counts; with few running, new ones
    decode speculatively (greedy: the same tokens); a request with a sampling setting the speculative path
    lacks goes to the plain engine at any load, with the tokens a plain engine alone gives it (same seed)."""
    from verl_moe.engines.rollout.engine import Request
    from verl_moe.engines.rollout.sampling import SamplingParams

    greedy = SamplingParams(max_tokens=10, temperature=0.0, logprobs=True)
    requests = [Request(f"r{i}", p, greedy) for i, p in enumerate(PROMPTS)]
    alone = {r.request_id: GenerationEngine(model, []).generate([r])[0] for r in requests}
    router = SpeculativeWhereItPays(
        SpeculativeEngine(model, [], num_draft_tokens=2), GenerationEngine(model, []), max_speculative=2
    )
    assert router.add(requests[:3]) == []  # 3 > 2: plain
    assert (router.speculative.num_running, router.plain.num_running) == (0, 3)
    router.add(requests[3:])  # 4 running: plain again
    assert router.plain.num_running == 4
    done = {c.request_id: c for c in router.step(10)}
    again = [Request(f"s{i}", p, greedy) for i, p in enumerate(PROMPTS[:2])]
    router.add(again)  # 2 running: speculative
    assert (router.speculative.num_running, router.plain.num_running) == (2, 0)
    while router.num_running:
        done.update((c.request_id, c) for c in router.step(4))
    for r in requests + again:
        ref = alone[r.request_id.replace("s", "r")]
        assert done[r.request_id].token_ids == ref.token_ids
        assert max(abs(a - b) for a, b in zip(done[r.request_id].log_probs, ref.log_probs)) <= TOL
    assert set(router.take_request_stats()) == {"s0", "s1"}  # draft counts of the speculative ones only

    top_k = Request("k", PROMPTS[0], SamplingParams(max_tokens=10, temperature=0.8, top_k=3, seed=7))
    router.add([top_k])
    assert router.plain.num_running == 1 and router.speculative.num_running == 0
    (out,) = router.step(10)
    assert out.token_ids == GenerationEngine(model, []).generate([top_k])[0].token_ids


# ---- refusals ----------------------------------------------------------------------------------


def test_refusals_name_the_key(model):
    with pytest.raises(ValueError, match=r"speculative_tokens=2 drafts with the model's MTP layer.*has none"):
        _adapter(_config(2), mtp_layers=0)
    with pytest.raises(ValueError, match=r"speculative_tokens is not exact.*ops.exact"):
        _adapter(_config(2, {"ops": {"exact": True}}))
    with pytest.raises(ValueError, match=r"speculative_tokens must be >= 0"):
        RolloutOptions(speculative_tokens=-1)
    with pytest.raises(ValueError, match=r"max_speculative must be >= 0"):
        RolloutOptions(speculative_tokens=2, max_speculative=-1)
    # what the speculative path lacks goes to the plain engine: served, not refused
    config = _config(2)
    server = MoeRolloutServer(config, engine=LocalEngineClient(adapter := _adapter(config)))
    asyncio.run(adapter.update_weights(vm.to_vllm_named_tensors(model), global_steps=1))
    for setting in ({"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.1}, {"repetition_penalty": 1.2}):
        out = asyncio.run(server.generate([1, 2], {"temperature": 1.0, "seed": 3, **setting}, "other"))
        assert len(out.token_ids) == config.response_length and "spec_num_draft_tokens" not in out.extra_fields


def test_verls_mtp_rollout_switch():
    """verl's `model.mtp` (the rollout config's `mtp`): enable_rollout with enable sets speculative_tokens to
    num_speculative_tokens; the rest is refused naming the key."""

    def options(speculative_tokens=0, **mtp):
        return RolloutOptions.from_rollout_config(_config(speculative_tokens, mtp=MtpConfig(**mtp)))

    assert options(enable=True, enable_rollout=True, num_speculative_tokens=3).speculative_tokens == 3
    assert options(3, enable=True, enable_rollout=True, num_speculative_tokens=3).speculative_tokens == 3
    assert options(enable=True).speculative_tokens == 0  # MTP trained, not used to roll out
    assert options(2, enable=True).speculative_tokens == 2
    with pytest.raises(ValueError, match=r"model.mtp.enable_rollout needs actor_rollout_ref.model.mtp.enable=true"):
        options(enable_rollout=True)
    with pytest.raises(ValueError, match=r"model.mtp.method='eagle'"):
        options(enable=True, enable_rollout=True, method="eagle")
    with pytest.raises(ValueError, match=r"speculative_tokens=2 disagrees with .*num_speculative_tokens=3"):
        options(2, enable=True, enable_rollout=True, num_speculative_tokens=3)


# ---- verl's trainer --------------------------------------------------------------------------------


MTP = "actor_rollout_ref.model.mtp"
SWITCHES = {  # speculation on, k = 2, through verl's switch or ours
    "verl": [f"{MTP}.enable=true", f"{MTP}.enable_rollout=true", f"{MTP}.num_speculative_tokens=2"],
    "ours": [f"{MTP}.enable=true", f"+{OPTIONS_KEY}.speculative_tokens=2"],
}


@pytest.mark.dist
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("switch", ["verl", pytest.param("ours", marks=pytest.mark.slow)])
def test_main_ppo_with_speculative_rollout(tmp_path_factory, tmp_path, switch):
    """`main_ppo` with recipe/tiny_cpu, 2 steps, on the toy model with one MTP layer, speculation on through
    verl's own switch (`model.mtp.enable`, `enable_rollout`, `num_speculative_tokens=2`) or through ours: the
    run's checks of `test_main_ppo.py` (finite metrics, the rollout follows the trained weights), the rollout's
    log-probs as close to the trainer's as in fast mode without speculation, and (verl's switch: its trainer
    logs them only under it) verl's `rollout/spec_accept_*` from our counts."""
    toy_rl = _toy_rl()
    paths = toy_rl.make(str(tmp_path_factory.mktemp("toy_spec")), task="arith", mtp_layers=1)
    steps = _run_main_ppo(toy_rl, paths, "tiny_cpu", tmp_path, SHORT_STEPS, SWITCHES[switch])
    _check_run(steps, SHORT_STEPS)
    for step in range(1, SHORT_STEPS + 1):
        metrics = steps[step]
        assert metrics["rollout/logprob_abs_diff_max"] <= 1e-4, (step, metrics)
        if switch == "verl":
            assert 0.0 <= metrics["rollout/spec_accept_rate"] <= 1.0, (step, metrics)
            assert 1.0 <= metrics["rollout/spec_accept_length"] <= 3.0, (step, metrics)
    log = (tmp_path / "main_ppo.log").read_text()
    assert "speculative decoding (MTP layer), 2 draft tokens per round" in log
