"""Decode steps as captured device graphs (`engines/rollout/graphs.py` StepGraphs, the rollout engine's default on
CUDA) against the same steps run eagerly: the same kernels on the same shapes, so logits, tokens and
log-probs must be bitwise equal. GPU only (CPU has no device graphs; the eager step's slot logic is
tested on CPU in test_decode.py and tests/engines/test_rollout_slots.py)."""

from __future__ import annotations

import pytest
import torch
import verl_moe.models as vm
from tiny_models import randomize_norms, tiny_qwen3_5_moe_text

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="device graphs need a CUDA device"),
]


def _model(dtype):
    torch.manual_seed(0)
    model = vm.build(tiny_qwen3_5_moe_text())
    randomize_norms(model)
    return model.to("cuda", dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_graph_step_equals_eager_step(dtype):
    """Prefill scattered slots, then steps over 4 slots with one of them idle: graph replays give the
    eager step's logits and leave the same state, and capturing does not disturb the running slots."""
    from verl_moe.engines.rollout.graphs import StepGraphs
    from verl_moe.models.decode import MoeDecoder

    decoder = MoeDecoder(_model(dtype))
    prompts, slots = [[5, 9, 3, 7, 1], [11], [2, 4, 6, 8]], [0, 3, 1]
    states = [decoder.allocate(4, 32) for _ in range(2)]
    first = [decoder.prefill(prompts, s, slots) for s in states]
    assert torch.equal(first[0], first[1])
    tokens = torch.zeros(2, 4, dtype=torch.long, device="cuda")
    tokens[:, slots] = first[0].argmax(-1)
    active = torch.tensor([True, True, False, True], device="cuda").repeat(2, 1)
    graphs = StepGraphs(decoder)
    for _ in range(6):
        eager = decoder.step(tokens[0], states[0], active[0])
        graph = graphs.step(tokens[1], states[1], active[1])
        assert torch.equal(eager, graph)
        tokens[:] = eager.argmax(-1)
    assert len(graphs.graphs) == 1
    assert torch.equal(states[0].lengths, states[1].lengths)
    for a, b in zip(states[0].layers, states[1].layers):
        assert all(torch.equal(x, y) for x, y in zip(vars(a).values(), vars(b).values()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_engine_with_graphs_equals_eager_engine(dtype):
    """The rollout engine with graphs (model step and sampling captured together) vs without, through
    slots that finish, free, take new requests and pack down (several batch sizes), with filters,
    stop ids, min_tokens and, from the 12th request on, repetition penalties (several sets of sampling
    steps, so several graphs per batch size, and a penalty mask that appears mid-run): tokens and
    log-probs bitwise equal."""
    from verl_moe.engines.rollout.engine import GenerationEngine, Request
    from verl_moe.engines.rollout.sampling import SamplingParams

    model = _model(dtype)
    vocab = model.arch.vocab_size

    def params(i):
        return SamplingParams(
            max_tokens=1 + (5 * i) % 9,
            temperature=0.0 if i % 3 == 0 else 1.0,
            logprobs=True,
            top_k=5 if i % 4 == 1 else -1,
            top_p=0.8 if i % 5 == 2 else 1.0,
            min_p=0.1 if i % 7 == 3 else 0.0,
            min_tokens=2 if i % 7 == 3 else 0,
            repetition_penalty=1.3 if i >= 12 and i % 2 == 0 else 1.0,
            stop_token_ids=(i % vocab,) if i % 6 == 0 else (),
        )

    requests = [
        Request(f"r{i}", tuple((7 * i + 3 * j) % vocab for j in range(1 + i % 5)), params(i)) for i in range(20)
    ]

    def run(graphs: bool) -> dict:
        engine = GenerationEngine(model, [], seed=3, max_num_seqs=8, sync_every=2, device_graphs=graphs)
        queue, done = list(requests), []
        while queue or engine.num_running:
            room = 8 - engine.num_running
            done += engine.add(queue[:room]) + engine.step(3)
            queue = queue[room:]
        if graphs:
            assert len(engine.graphs.graphs) > 1
        return {c.request_id: (c.token_ids, c.log_probs) for c in done}

    assert run(True) == run(False)


def test_engine_captures_again_after_requests_trickle_in():
    """Requests arriving one wave at a time (as verl's agent loop sends them) grow the slots between
    steps, so the graphs are dropped and captured again several times while earlier outputs are alive
    (a capture into the dropped graphs' memory pool failed inside the allocator): tokens and log-probs
    bitwise equal to the eager engine's."""
    from verl_moe.engines.rollout.engine import GenerationEngine, Request
    from verl_moe.engines.rollout.sampling import SamplingParams

    model = _model(torch.bfloat16)
    params = SamplingParams(max_tokens=12, temperature=1.0, logprobs=True, seed=3)
    waves = [[Request(f"w{w}-{i}", [1 + w, 2 + i, 3], params) for i in range(n)] for w, n in enumerate((1, 2, 5, 9))]

    def run(graphs):
        engine = GenerationEngine(model, [], seed=0, max_num_seqs=32, device_graphs=graphs)
        done = []
        for wave in waves:
            done += engine.add(wave) + engine.step(2)
        while engine.num_running:
            done += engine.step(4)
        return {c.request_id: (c.token_ids, c.log_probs) for c in done}

    eager = run(False)
    assert len(eager) == sum(len(w) for w in waves)
    assert run(True) == eager


def test_fresh_engine_captures_without_warm_up_and_equals_eager():
    """A fresh engine per RL step (verl's `free_cache_engine`): the second engine in the process captures the
    shapes the first one warmed up without an eager step; its tokens and log-probs equal the first engine's and
    the eager engine's bitwise."""
    from verl_moe.engines.rollout import graphs as graphs_module
    from verl_moe.engines.rollout.engine import GenerationEngine, Request
    from verl_moe.engines.rollout.sampling import SamplingParams

    model = _model(torch.bfloat16)
    params = SamplingParams(max_tokens=10, temperature=1.0, logprobs=True, seed=5)
    requests = [Request(f"f{i}", [3 + i, 5, 7 + 2 * i][: 1 + i % 3], params) for i in range(6)]

    def run(graphs):
        engine = GenerationEngine(model, [], seed=1, max_num_seqs=8, device_graphs=graphs)
        done = engine.add(requests)
        while engine.num_running:
            done += engine.step(3)
        return {c.request_id: (c.token_ids, c.log_probs) for c in done}

    first = run(True)
    warmed = set(graphs_module._WARMED)
    assert warmed
    second = run(True)
    assert graphs_module._WARMED == warmed  # the second engine met only shapes the first had warmed up
    assert first == second == run(False)


def test_speculative_rounds_as_graphs_equal_eager_rounds():
    """Speculative rounds (MTP catch-up, drafts, verification, acceptance, commit) captured per slot bucket vs
    run eagerly, greedy and sampled requests mixed, arriving in two waves (slots grow, buckets change): tokens
    and log-probs bitwise equal, and the acceptance counts the same."""
    from verl_moe.engines.rollout.engine import Request
    from verl_moe.engines.rollout.sampling import SamplingParams
    from verl_moe.engines.rollout.speculative import SpeculativeEngine

    torch.manual_seed(0)
    model = vm.build(tiny_qwen3_5_moe_text(mtp_num_hidden_layers=1))
    randomize_norms(model)
    model = model.to("cuda", torch.bfloat16).eval()

    def params(i):
        return SamplingParams(max_tokens=6 + i % 7, temperature=0.0 if i % 3 == 0 else 1.0, logprobs=True, seed=i)

    waves = [
        [Request(f"s{w}-{i}", [1 + w, 2 + i, 3 + i % 4][: 1 + i % 3], params(i)) for i in range(n)]
        for w, n in enumerate((3, 6))
    ]

    def run(graphs):
        engine = SpeculativeEngine(model, [], num_draft_tokens=3, device_graphs=graphs)
        done = []
        for wave in waves:
            done += engine.add(wave) + engine.step(2)
        while engine.num_running:
            done += engine.step(2)
        if graphs:
            assert len(engine.graphs.graphs) >= 1
        return {c.request_id: (c.token_ids, c.log_probs) for c in done}, (engine.stats.drafted, engine.stats.accepted)

    eager = run(False)
    assert len(eager[0]) == 9
    assert run(True) == eager
