"""Speculative decoding with the MTP layer (`engines/rollout/speculative.py`) on a tiny fp32 Qwen3.5-MoE whose
MTP layer was fitted for a few steps to the model's own samples (so drafts are both kept and rejected):

- greedy: the tokens of plain greedy decoding (`GenerationEngine`), k = 1, 2, 3, stop ids included;
- sampled: the first and second speculated tokens follow the target's exact next-token distribution (a
  chi-squared test over 2000 requests of one prompt, each with its own seed), and the same test rejects the
  speculated tokens of two wrong acceptance rules (always accept; resample from p instead of the residual);
- after each round, rejected drafts included, the slots' state equals that of plain decoding of the
  accepted tokens, and the MTP layer's cache that of its forward over them; also with the GatedDeltaNet state
  ops in their Triton kernels (interpreter), as on cuda, where the verification and the commit run every
  position in one launch.

Tolerances:
| what                                                              | dtype | tol                   |
| log-probs vs GenerationEngine (per token step vs chunked verify)  | fp32  | 1e-5 max abs          |
| GDN conv / recurrent state, KV cache vs plain decoding            | fp32  | 1e-5 max abs          |
| chi-squared p-value: correct rule / wrong rule                    |       | > 1e-3 / < 1e-6       |
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter, defaultdict

import pytest
import torch
import torch.nn.functional as F
from engine_setup import VOCAB, tiny_config, tiny_model
from verl_moe.engines.rollout import speculative
from verl_moe.engines.rollout.engine import GenerationEngine, Request
from verl_moe.engines.rollout.sampling import SamplingParams
from verl_moe.engines.rollout.speculative import SpeculativeEngine, accept_drafts
from verl_moe.models.decode import AttentionCache, LinearCache, MoeDecoder
from verl_moe.models.mtp_decode import MtpDrafter
from verl_moe.ops import resolve
from verl_moe.ops.sampling import inverse_cdf
from verl_moe.tools.bench.exact import use_ops

PROMPTS = [(5, 9, 3, 7, 1), (11,), (2, 4, 6, 8, 10, 12, 14), (3, 3, 3)]
TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's ops are too small to share: threads contending with other processes on a small
    host slow the module down many times."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return fitted_model()


def fitted_model():
    """Tiny Qwen3.5-MoE with one MTP layer, lm_head sharpened, the MTP layer fitted for 60 Adam steps to
    predict token t+2 on 32 continuations of the model's own (half greedy, half sampled)."""
    config = tiny_config()
    config.mtp_num_hidden_layers = 1
    m = tiny_model(config).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(10.0)
    gen = torch.Generator().manual_seed(0)
    prompts = [tuple(torch.randint(1, VOCAB, (4,), generator=gen).tolist()) for _ in range(32)]
    sampled, greedy = SamplingParams(max_tokens=28, ignore_eos=True), SamplingParams(max_tokens=28, temperature=0.0)
    requests = [Request(f"d{i}", p, sampled if i % 2 else greedy) for i, p in enumerate(prompts)]
    outs = GenerationEngine(m, eos_token_ids=[]).generate(requests)
    ids = torch.tensor([list(p) + c.token_ids for p, c in zip(prompts, outs)])
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    with torch.no_grad():
        hidden = m(ids, pos).last_hidden_state
    opt = torch.optim.Adam(m.mtp.parameters(), lr=3e-3)
    for _ in range(60):
        mtp = m.mtp_hidden_states(hidden, ids, pos)[0]
        loss = F.cross_entropy(m.logits(mtp[:, :-2]).reshape(-1, VOCAB).float(), ids[:, 2:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m.requires_grad_(False)


# ---- greedy --------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_equals_plain_decoding(model, k):
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=True)
    requests = [Request(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]
    plain = GenerationEngine(model, eos_token_ids=[]).generate(requests)
    eos = plain[0].token_ids[9]  # ends some requests mid-round
    plain = GenerationEngine(model, eos_token_ids=[eos]).generate(requests)
    engine = SpeculativeEngine(model, eos_token_ids=[eos], num_draft_tokens=k)
    spec = engine.generate(requests)
    for a, b in zip(spec, plain):
        assert (a.request_id, a.token_ids, a.finish_reason) == (b.request_id, b.token_ids, b.finish_reason)
        assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs)) <= TOL
    assert "stop" in {c.finish_reason for c in spec} and "length" in {c.finish_reason for c in spec}
    assert engine.stats.all_kept and engine.stats.rejected  # rounds with a bonus token, rounds rolled back


def test_sampled_log_probs_are_the_targets_at_the_temperature(model):
    """Sampled requests at temperatures 0.7 and 1.3 beside a greedy one: every returned log-prob is the
    target's log_softmax(logits / T) at that token after the tokens before it (a greedy request's at T = 1)."""
    temps = [0.7, 1.3, 0.0, 0.7]
    requests = [
        Request(f"r{i}", p, SamplingParams(max_tokens=12, temperature=t, ignore_eos=True, seed=i, logprobs=True))
        for i, (p, t) in enumerate(zip(PROMPTS, temps))
    ]
    engine = SpeculativeEngine(model, eos_token_ids=[], num_draft_tokens=2)
    for r, c, t in zip(requests, engine.generate(requests), temps):
        probs = _target_probs(model, r.prompt_ids, [c.token_ids[:i] for i in range(len(c.token_ids))], t or 1.0)
        want = probs.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0].log()
        assert (torch.tensor(c.log_probs, dtype=torch.float64) - want).abs().max() <= TOL
    assert engine.stats.all_kept and engine.stats.rejected


# ---- sampled: the target's distribution --------------------------------------------------------


def _always_accept(target, draft, drafts, ks, u_accept, u_final):
    rows = torch.arange(len(ks))
    return ks, inverse_cdf(target[rows, ks], u_final)


def _resample_from_target(target, draft, drafts, ks, u_accept, u_final):
    """Right acceptance test, but a rejection redraws from p instead of max(0, p - q)."""
    K = drafts.shape[1]
    p_d = target[:, :K].gather(-1, drafts[:, :, None])[..., 0].double()
    q_d = draft.gather(-1, drafts[:, :, None])[..., 0].double()
    keep = (u_accept * q_d < p_d) & (torch.arange(K)[None] < ks[:, None])
    j = keep.long().cumprod(-1).sum(-1)
    return j, inverse_cdf(target[torch.arange(len(ks)), j], u_final)


def _target_probs(model, prompt, prefixes, temperature):
    """[len(prefixes), VOCAB] fp64: the target's next-token distribution after prompt + each prefix."""
    rows = [list(prompt) + list(p) for p in prefixes]
    cu = torch.tensor([0] + [len(r) for r in rows]).cumsum(0)
    ids = torch.tensor([t for r in rows for t in r])[None]
    pos = torch.cat([torch.arange(len(r)) for r in rows])[None]
    with torch.no_grad():
        hidden = model(ids, pos, cu.to(torch.int32)).last_hidden_state[0]
    return torch.softmax(model.logits(hidden[cu[1:] - 1]).double() / temperature, -1)


def _chi_squared(model, prompt, samples, depth, temperature, min_count=20):
    """Pearson's test that token `depth` of the samples follows the target's distribution given the tokens
    before it: per group of samples sharing those tokens (at least min_count), the cells expected >= 5 and
    one cell pooling the rest; the groups' statistics and degrees of freedom summed. Returns (p-value, dof)."""
    groups: dict[tuple, Counter] = defaultdict(Counter)
    for s in samples:
        groups[tuple(s[:depth])][s[depth]] += 1
    keys = [key for key, c in groups.items() if sum(c.values()) >= min_count]
    stat, dof = 0.0, 0
    for key, p in zip(keys, _target_probs(model, prompt, keys, temperature)):
        counts = groups[key]
        observed = torch.tensor([counts[v] for v in range(VOCAB)], dtype=torch.float64)
        expected = sum(counts.values()) * p
        big = expected >= 5
        o = torch.cat([observed[big], observed[~big].sum()[None]])
        e = torch.cat([expected[big], expected[~big].sum()[None]])
        o, e = o[e > 0], e[e > 0]
        stat += ((o - e) ** 2 / e).sum().item()
        dof += len(o) - 1
    return _p_value(stat, dof), dof


def _p_value(stat: float, dof: int) -> float:
    """P(chi-squared with dof degrees of freedom >= stat)."""
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)).item()


@pytest.mark.parametrize(
    "rule", [accept_drafts, _always_accept, _resample_from_target], ids=["right", "always", "resample"]
)
def test_sampled_tokens_follow_target(model, monkeypatch, rule):
    """2000 requests of one prompt, each with its own seed, k = 2, 3 tokens each: token 1 is the prompt's
    plain draw, tokens 2 and 3 come from the first round (a kept draft, a residual or a bonus token)."""
    monkeypatch.setattr(speculative, "accept_drafts", rule)
    prompt, temperature = PROMPTS[0], 0.8
    params = [SamplingParams(max_tokens=3, temperature=temperature, ignore_eos=True, seed=s) for s in range(2000)]
    engine = SpeculativeEngine(model, eos_token_ids=[], num_draft_tokens=2)
    samples = [c.token_ids for c in engine.generate([Request(f"r{i}", prompt, p) for i, p in enumerate(params)])]
    (second, dof), (third, _) = (_chi_squared(model, prompt, samples, n, temperature) for n in (1, 2))
    assert dof >= 20, "too few samples per context for the test"
    if rule is accept_drafts:
        assert 0.1 < engine.stats.acceptance < 0.9
        assert second > 1e-3 and third > 1e-3, (second, third)
    else:  # token 3 shares few contexts with enough samples: the test's power is on token 2 (and below)
        assert second < 1e-6, second


@pytest.mark.parametrize(
    "rule", [accept_drafts, _always_accept, _resample_from_target], ids=["right", "always", "resample"]
)
def test_rule_keeps_joint_distribution(rule):
    """The rule alone on a 5-token vocabulary with k = 2, where p and q of the second position depend on
    the first token: the round's first two tokens (a second token drawn from p directly after a rejection
    at the first draft) must follow p_0(a) p_1(b | a), 20000 rounds, 25 cells."""
    V, N, gen = 5, 20000, torch.Generator().manual_seed(0)

    def table(*shape):
        return torch.softmax(torch.randn(*shape, V, generator=gen, dtype=torch.float64) * 1.5, -1)

    p0, p1, p2 = table(), table(V), table(V, V)
    q1, q2 = table(), table(V)
    d1 = torch.multinomial(q1, N, replacement=True, generator=gen)
    d2 = torch.multinomial(q2[d1], 1, generator=gen)[:, 0]
    target = torch.stack([p0.expand(N, V), p1[d1], p2[d1, d2]], 1)
    draft = torch.stack([q1.expand(N, V), q2[d1]], 1)
    u = torch.rand(N, 4, generator=gen, dtype=torch.float64)
    j, y = rule(target, draft, torch.stack([d1, d2], 1), torch.full((N,), 2), u[:, :2], u[:, 2])
    first = torch.where(j == 0, y, d1)
    # the second token: d2 when both kept, y after one kept, drawn from p1 after a rejection at the first
    second = torch.where(j == 2, d2, torch.where(j == 1, y, inverse_cdf(p1[first], u[:, 3])))
    counts = torch.zeros(V, V, dtype=torch.float64).index_put_(
        (first, second), torch.ones(N, dtype=torch.float64), accumulate=True
    )
    expected = N * p0[:, None] * p1
    p_value = _p_value(((counts - expected) ** 2 / expected).sum().item(), V * V - 1)
    assert p_value > 1e-3 if rule is accept_drafts else p_value < 1e-6, p_value


def test_same_seed_same_tokens(model):
    """A request's tokens follow its seed: alone, or admitted while others run (the slots grow then)."""
    params = SamplingParams(max_tokens=12, temperature=1.0, logprobs=True, seed=7)
    alone = SpeculativeEngine(model, eos_token_ids=[], num_draft_tokens=3).generate([Request("a", PROMPTS[2], params)])
    again = SpeculativeEngine(model, eos_token_ids=[], num_draft_tokens=3).generate([Request("a", PROMPTS[2], params)])
    assert again == alone
    engine = SpeculativeEngine(model, eos_token_ids=[], num_draft_tokens=3)
    done = engine.add([Request(f"o{i}", p, SamplingParams(max_tokens=9, seed=i)) for i, p in enumerate(PROMPTS)])
    done += engine.step() + engine.step()
    done += engine.add([Request("a", PROMPTS[2], params)])
    while engine.num_running:
        done += engine.step()
    batched = next(c for c in done if c.request_id == "a")
    assert len(done) == 5 and batched.token_ids == alone[0].token_ids
    assert max(abs(x - y) for x, y in zip(batched.log_probs, alone[0].log_probs)) <= TOL


# ---- state after rejections --------------------------------------------------------------------


def _plain_state(model, consumed):
    """The decoder's state after prefilling consumed[0] and stepping through the rest one token at a time."""
    decoder = MoeDecoder(model)
    state = decoder.allocate(1, 64)
    decoder.prefill([consumed[:1]], state, [0])
    for t in consumed[1:]:
        decoder.step(torch.tensor([t]), state)
    return state


def _mtp_cache(model, consumed, positions):
    """The MTP layer's KV cache from its forward over the consumed tokens' main hidden states."""
    ids = torch.tensor([consumed])
    hidden = model(ids, torch.arange(len(consumed))[None]).last_hidden_state[0]
    drafter = MtpDrafter(MoeDecoder(model))
    cache = drafter.allocate(1, 64)
    drafter.forward(hidden[:positions], [consumed[1 : positions + 1]], cache, [0], [0])
    return cache.attention


def _close(a, b):
    return (a - b).abs().max().item() <= TOL


def _with_triton_state_steps(model):
    """The model with its GatedDeltaNet decode ops (one-token steps and the verification's multi-position forms)
    in their Triton kernels (the interpreter on CPU), as on cuda; everything else as resolved."""
    kernels = {field: resolve(op, "triton") for field, op in TRITON_STATE_OPS.items()}
    use_ops(model, dataclasses.replace(model.ops, **kernels))
    return model


TRITON_STATE_OPS = {
    "conv1d_step": "conv1d.step",
    "gdn_step": "gdn.step",
    "conv1d_positions": "conv1d.positions",
    "gdn_positions": "gdn.positions",
}


@pytest.mark.parametrize(
    "temperature, k, kernels", [(0.0, 3, False), (1.0, 2, False), (1.0, 2, True)],
    ids=["greedy-k3", "sampled-k2", "sampled-k2-triton"],
)  # fmt: skip
def test_state_keeps_only_accepted_tokens(model, temperature, k, kernels):
    """After every round the slots' states are those of plain decoding of the accepted tokens (rejected drafts
    rolled back); also with the state ops' Triton kernels, whose verification runs all positions in one launch."""
    if kernels:
        model = _with_triton_state_steps(copy.deepcopy(model))
    params = SamplingParams(max_tokens=16, temperature=temperature, ignore_eos=True, seed=3)
    requests = [Request(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]
    engine = SpeculativeEngine(model, eos_token_ids=[], num_draft_tokens=k)
    engine.add(requests)
    outcomes = Counter()
    while engine.num_running:
        seqs = {s.request.request_id: s for s in engine._seqs if s is not None}
        engine.step()
        for rid, s in seqs.items():
            if s.finish is not None:
                continue
            drafted, accepted = engine.last_round[rid]
            outcomes["rejected" if accepted < drafted else "all kept"] += 1
            consumed = list(s.request.prompt_ids) + s.tokens[:-1]  # the last token is fed next round
            plain = _plain_state(model, consumed)
            assert int(engine.state.lengths[s.slot]) == len(consumed)
            for ours, ref in zip(engine.state.layers, plain.layers):
                if isinstance(ours, LinearCache):
                    assert _close(ours.conv[s.slot], ref.conv[0]) and _close(ours.recurrent[s.slot], ref.recurrent[0])
                else:
                    assert isinstance(ours, AttentionCache)
                    n = len(consumed)
                    assert _close(ours.k[s.slot, :, :n], ref.k[0, :, :n])
                    assert _close(ours.v[s.slot, :, :n], ref.v[0, :, :n])
            # the MTP layer has seen the positions before this round's last kept one
            n = int(engine.inputs.mtp_start[s.slot])
            mtp = _mtp_cache(model, consumed, n)
            assert _close(engine.mtp_cache.attention.k[s.slot, :, :n], mtp.k[0, :, :n])
    assert outcomes["rejected"] and outcomes["all kept"], outcomes


# ---- refusals ----------------------------------------------------------------------------------


def test_refusals(model):
    with pytest.raises(ValueError, match="needs the MTP layer"):
        SpeculativeEngine(tiny_model(), eos_token_ids=[])
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpeculativeEngine(model, eos_token_ids=[], num_draft_tokens=0)
    engine = SpeculativeEngine(model, eos_token_ids=[])
    with pytest.raises(ValueError, match=r"does not implement \['top_k'\]"):
        engine.add([Request("a", (1, 2), SamplingParams(max_tokens=4, top_k=5))])
