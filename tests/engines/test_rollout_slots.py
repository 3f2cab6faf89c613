"""Our rollout engine's fixed decode slots (`engines/rollout/engine.py`), without verl or Ray: slots
finish, free, are reused and packed down; a full engine refuses with one line and admits nothing;
abort returns what was generated; the device-side stream numbers equal the host's. The device-graph
engine is checked against the eager one in tests/models/test_decode_graphs.py (GPU).

Reference: each request generated alone in a fresh engine (one request, one slot). Its tokens must be
equal (fixed seeds and streams: deterministic); its log-probs within 1e-5 (fp32: the same request in
another batch runs through GEMMs of another row count, last-bit differences).
"""

from __future__ import annotations

import pytest
import torch
import verl_moe.models as vm
from tiny_models import hf_causal_lm, randomize_norms, tiny_qwen3_5_moe_text, tiny_qwen3_moe
from verl_moe.engines.rollout.engine import GenerationEngine, Request
from verl_moe.engines.rollout.sampling import SamplingParams

VOCAB = tiny_qwen3_5_moe_text().vocab_size


def _model(dtype=torch.float32, device="cpu") -> vm.MoeCausalLM:
    """Tiny Qwen3.5-MoE: GatedDeltaNet, attention and MoE layers, random norms."""
    torch.manual_seed(0)
    model = vm.build(tiny_qwen3_5_moe_text())
    randomize_norms(model)
    return model.to(device, dtype).eval()


def _requests(n: int) -> list[Request]:
    """n requests of distinct prompts and lengths: greedy and sampled ones, short and long budgets."""
    out = []
    for i in range(n):
        prompt = tuple((7 * i + 3 * j) % VOCAB for j in range(1 + i % 5))
        params = SamplingParams(max_tokens=1 + (5 * i) % 9, temperature=0.0 if i % 3 == 0 else 1.0, logprobs=True)
        out.append(Request(f"r{i}", prompt, params))
    return out


def _alone(model, requests) -> dict:
    return {r.request_id: GenerationEngine(model, [], seed=3).generate([r])[0] for r in requests}


def _assert_same(done: list, alone: dict, tol: float = 1e-5) -> None:
    assert sorted(c.request_id for c in done) == sorted(alone)
    for c in done:
        ref = alone[c.request_id]
        assert c.token_ids == ref.token_ids, c.request_id
        assert c.finish_reason == ref.finish_reason
        assert max(abs(a - b) for a, b in zip(c.log_probs, ref.log_probs)) <= tol


def test_slots_are_freed_reused_and_each_request_decodes_as_alone():
    """Twelve requests through four slots, admitted as slots free (syncing every 3 steps): every
    request's tokens equal its generation alone, and the engine never holds more than four slots."""
    model = _model()
    requests = _requests(12)
    engine = GenerationEngine(model, [], seed=3, max_num_seqs=4, sync_every=3)
    queue, done = list(requests), []
    while queue or engine.num_running:
        room = 4 - engine.num_running
        done += engine.add(queue[:room]) + engine.step(2)
        queue = queue[room:]
        assert len(engine._slots) <= 4
    _assert_same(done, _alone(model, requests))


def test_prefill_in_token_bounded_groups_and_chunks_decodes_as_one_prefill():
    """An admission split into prefill forwards of at most 3 prompt tokens (a longer prompt alone, in
    chunks of 3) gives every request the tokens and log-probs of one packed prefill of all of them."""
    model = _model()
    requests = _requests(12)
    requests.append(Request("long", tuple(range(1, 12)), SamplingParams(max_tokens=6, logprobs=True)))
    one = {c.request_id: c for c in GenerationEngine(model, [], seed=3).generate(requests)}
    engine = GenerationEngine(model, [], seed=3, max_prefill_tokens=3)
    groups = engine._prefill_groups(requests)
    assert [n for g in groups for n in g] == list(range(13)) and len(groups) > 1
    assert all(len(g) == 1 or sum(len(requests[n].prompt_ids) for n in g) <= 3 for g in groups)
    _assert_same(engine.generate(requests), one)


def test_long_prompt_prefills_in_chunks_between_the_others_steps():
    """A prompt of 11 tokens with 3-token prefills takes its slot with its first chunk and prefills one
    more chunk per sync_every steps of the running requests (they keep decoding meanwhile); every
    request, the long one included, gets the tokens and log-probs of its generation alone."""
    model = _model()
    long = Request("long", tuple(range(1, 12)), SamplingParams(max_tokens=5, temperature=1.0, logprobs=True))
    short = [Request(f"s{i}", (i + 1, 2 * i + 3), SamplingParams(max_tokens=9, logprobs=True)) for i in range(3)]
    engine = GenerationEngine(model, [], seed=3, max_prefill_tokens=3, sync_every=2)

    def prefilled():
        return next(r.prefilled for r in engine._slots if r is not None and r.request.request_id == "long")

    done = engine.add(short + [long])
    assert prefilled() == 3 and engine.num_running == 4
    counts = engine._t["count"].tolist()
    done += engine.step(2)
    assert prefilled() == 6
    assert sum(engine._t["count"].tolist()) == sum(counts) + 2 * 3  # the others stepped twice meanwhile
    while engine.num_running:
        done += engine.step(2)
    _assert_same(done, _alone(model, short + [long]))
    engine.add([Request("again", long.prompt_ids, long.params)])
    aborted = engine.abort_all()  # a prompt still being prefilled aborts with nothing generated
    assert [(c.request_id, c.token_ids, c.finish_reason) for c in aborted] == [("again", [], "abort")]


def test_running_slots_are_packed_down_when_low_ones_finish():
    """Eight slots, the first six finish after one token: the two long requests move to slots 0 and 1
    (so steps run at batch 2) and still decode as alone."""
    model = _model()
    requests = [Request(f"s{i}", (i + 1, 2 * i + 1), SamplingParams(max_tokens=1, temperature=0.0)) for i in range(6)]
    requests += [
        Request(f"l{i}", (i + 5,), SamplingParams(max_tokens=9, temperature=1.0, logprobs=True)) for i in range(2)
    ]
    engine = GenerationEngine(model, [], seed=3, max_num_seqs=8)
    done = engine.add(requests)
    assert sorted(c.request_id for c in done) == [f"s{i}" for i in range(6)]
    done += engine.step(1)
    assert [i for i, r in enumerate(engine._slots) if r is not None] == [0, 1]
    while engine.num_running:
        done += engine.step(4)
    alone = _alone(model, requests)
    for c in done:
        assert c.token_ids == alone[c.request_id].token_ids


def test_new_engine_reserving_the_old_ones_sizes_admits_one_by_one_without_growing():
    """Requests arriving one at a time (verl's agent loop) grow a fresh engine's slots several times
    (each growth reallocates them and drops captured graphs); a new engine that reserves the old one's
    `sizes` takes the same arrivals into the slots it reserved, never reallocating, with the same
    tokens (log-probs within 1e-5: attention over a longer cache reduces in another order)."""
    model = _model()
    requests = _requests(12)

    def one_by_one(engine):
        done = []
        for r in requests:
            done += engine.add([r]) + engine.step(1)
        while engine.num_running:
            done += engine.step(4)
        return done

    first = GenerationEngine(model, [], seed=3)
    done = one_by_one(first)
    assert first._state.version > 0  # grew after its first allocation
    again = GenerationEngine(model, [], seed=3)
    again.reserve(**first.sizes)
    state, tokens = again._state, again._t["tokens"]
    _assert_same(one_by_one(again), {c.request_id: c for c in done})
    assert again._state is state and state.version == 0 and again._t["tokens"] is tokens
    assert again.sizes == first.sizes


def test_full_engine_refuses_with_one_line_and_admits_nothing():
    model = _model()
    requests = [
        Request(f"f{i}", (i + 2,), SamplingParams(max_tokens=6, temperature=1.0, logprobs=True)) for i in range(3)
    ]
    engine = GenerationEngine(model, [], seed=3, max_num_seqs=2)
    done = engine.add(requests[:2])
    with pytest.raises(ValueError, match=r"do not fit: 2 of max_num_seqs=2 slots are running"):
        engine.add(requests[2:])
    while engine.num_running:
        done += engine.step(4)
    done += engine.generate(requests[2:])
    _assert_same(done, _alone(model, requests))


def test_abort_returns_what_was_generated_and_the_engine_goes_on():
    model = _model()
    requests = [
        Request(f"a{i}", (i + 1, 9), SamplingParams(max_tokens=8, temperature=1.0, logprobs=True)) for i in range(3)
    ]
    engine = GenerationEngine(model, [], seed=3)
    engine.add(requests)
    engine.step(3)
    aborted = engine.abort_all()
    alone = _alone(model, requests)
    assert engine.num_running == 0 and len(aborted) == 3
    for c in aborted:
        assert c.finish_reason == "abort" and len(c.token_ids) == 4  # the prefill's token + 3 steps
        assert c.token_ids == alone[c.request_id].token_ids[:4]
    _assert_same(engine.generate(_requests(5)), _alone(model, _requests(5)))


def test_seeded_request_gives_its_tokens_alone_in_a_batch_of_64_and_in_any_order():
    """Sampled requests with their own seeds: each one's tokens alone equal its tokens among 64 requests
    admitted together, and among the same 64 arriving in reverse order in two waves."""
    model = _model()
    requests = [
        Request(f"q{i}", ((5 * i) % VOCAB, (11 * i + 1) % VOCAB), SamplingParams(max_tokens=6, temperature=1.0, seed=i))
        for i in range(64)
    ]
    together = {c.request_id: c.token_ids for c in GenerationEngine(model, [], max_num_seqs=64).generate(requests)}
    engine = GenerationEngine(model, [], max_num_seqs=64)
    done = engine.add(requests[::-1][:40]) + engine.step(2) + engine.add(requests[::-1][40:])
    while engine.num_running:
        done += engine.step(3)
    assert {c.request_id: c.token_ids for c in done} == together
    for i in (0, 31, 63):
        alone = GenerationEngine(model, []).generate([requests[i]])[0]
        assert alone.token_ids == together[f"q{i}"]


# a greedy choice between two tokens whose fp32 logits differ by less than this may go either way
# between two implementations (both sum the same products in other orders: ~1e-6 apart on this model)
NEAR_TIE = 1e-4


@pytest.mark.parametrize("make_config", [tiny_qwen3_5_moe_text, tiny_qwen3_moe], ids=["qwen3_5_moe", "qwen3_moe"])
def test_greedy_generation_equals_transformers_generate(make_config):
    """fp32 on CPU: six prompts decoded together by our engine give, token for token, what transformers'
    `generate` (greedy, one prompt at a time, same weights) gives each, and our log-probs are the
    log-softmax of its scores; a sequence may part from transformers' only at a near-tie of its
    logits (then the rest is not compared)."""
    torch.manual_seed(0)
    config = make_config()
    model = vm.build(config)
    randomize_norms(model)
    model.eval()
    hf = hf_causal_lm(config, model)
    vocab, new = config.vocab_size, 12
    prompts = [tuple((11 * i + 5 * j) % vocab for j in range(2 + 3 * i)) for i in range(6)]
    params = SamplingParams(max_tokens=new, temperature=0.0, logprobs=True, ignore_eos=True)
    ours = GenerationEngine(model, [], seed=3).generate([Request(f"p{i}", p, params) for i, p in enumerate(prompts)])
    compared = 0
    for prompt, done in zip(prompts, ours):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new, min_new_tokens=new,
                pad_token_id=0, eos_token_id=None, output_scores=True, return_dict_in_generate=True,
            )  # fmt: skip
        theirs = out.sequences[0, len(prompt) :].tolist()
        assert len(done.token_ids) == len(theirs) == new
        for t, (a, b) in enumerate(zip(done.token_ids, theirs)):
            scores = out.scores[t][0]
            if a != b:
                assert scores[b] - scores[a] <= NEAR_TIE, (prompt, t)
                break
            assert abs(done.log_probs[t] - torch.log_softmax(scores, -1)[a].item()) <= 1e-5
            compared += 1
    assert compared >= len(prompts) * new // 2  # ties are rare: most tokens are compared


def test_rollout_bench_passes_run_on_cpu():
    """`verl-moe bench rollout`'s timed passes on the tiny model (eager on CPU): every request of every pass
    generates exactly its new tokens in one engine that keeps its slots between passes."""
    from verl_moe.tools.bench.rollout import _ours, _prompts

    passes = [(_prompts(6, 5, VOCAB, 1), 4), (_prompts(6, 3, VOCAB, 2), 7), (_prompts(6, 3, VOCAB, 3), 7)]
    runs = _ours(_model(), graphs=False, passes=passes)
    assert [r["steps"] for r in runs] == [3, 6, 6]
    assert all(r["decode_ms"] > 0 and r["prefill_ms"] > 0 for r in runs)


def test_rollout_bench_rl_batches_on_cpu():
    """The RL-shaped case's requests and its fresh engine on the tiny model: lengths drawn in the given
    ranges from the seed (the same seed gives the same batch, another seed another), and a fresh engine
    returns every request with exactly the tokens it asked for and one log-prob each, the tokens of each
    generated alone in its own engine (log-probs within fp32's row-count differences)."""
    from verl_moe.tools.bench.rollout import generate_fresh, rl_requests

    batch = rl_requests(8, VOCAB, seed=0, prompt_lens=(1, 9), new_tokens=(1, 6))
    assert all(1 <= len(r.prompt_ids) <= 9 and 1 <= r.params.max_tokens <= 6 for r in batch)
    assert [r.prompt_ids for r in batch] == [r.prompt_ids for r in rl_requests(8, VOCAB, 0, (1, 9), (1, 6))]
    assert [r.prompt_ids for r in batch] != [r.prompt_ids for r in rl_requests(8, VOCAB, 1, (1, 9), (1, 6))]
    run = generate_fresh(_model(), batch, graphs=False)
    assert [len(c.token_ids) for c in run["done"]] == [r.params.max_tokens for r in batch]
    assert [len(c.log_probs) for c in run["done"]] == [r.params.max_tokens for r in batch]
    assert run["steps"] == max(r.params.max_tokens for r in batch) - 1
    alone = {r.request_id: GenerationEngine(_model(), [], seed=0).generate([r])[0] for r in batch}
    _assert_same(run["done"], alone)
