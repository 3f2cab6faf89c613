"""Decoding (`models/decode.py`) and its step ops against the full forward and the references.

Tolerances:
| what                                                    | dtype | measure        | tol   |
| decode log-probs / logits vs packed full forward        | fp32  | max abs / rel  | 1e-5  |
| conv1d step over a sequence vs causal_conv1d_ref        | fp64  | rel RMS        | 1e-12 |
| gdn step (torch) over a sequence vs recurrent reference | fp64  | rel RMS        | 1e-12 |
| gdn step state after a sequence vs chunked reference    | fp32  | rel RMS        | 1e-5  |
"""

import copy

import pytest
import torch
import verl_moe.models as vm
from tiny_models import randomize_norms, tiny_qwen3_5_moe_text, tiny_qwen3_moe
from verl_moe.engines.rollout.weights import load_named_tensors
from verl_moe.models.decode import LinearCache, MoeDecoder
from verl_moe.models.layers import joined_weight
from verl_moe.ops.compare import assert_rel_rms
from verl_moe.ops.conv1d import causal_conv1d_ref
from verl_moe.ops.conv1d.step import causal_conv1d_step_ref, conv1d_state_from_prefill
from verl_moe.ops.gdn import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref
from verl_moe.ops.gdn.step import gated_delta_rule_step, gated_delta_rule_step_ref

PROMPTS = [[5, 9, 3, 7, 1], [11], [2, 4, 6, 8, 10, 12, 14, 16, 18]]  # a 1-token prompt, one shorter than W-1
NEW_TOKENS = 6


def _model(config):
    torch.manual_seed(0)
    model = vm.build(config)
    randomize_norms(model)
    return model.eval()


def _full_forward_logits(model, sequences):
    """Packed forward of whole sequences -> per-sequence fp32 logits [T_n, VOCAB]."""
    ids = torch.tensor([t for s in sequences for t in s])[None]
    pos = torch.cat([torch.arange(len(s)) for s in sequences])[None]
    cu = torch.tensor([0, *torch.tensor([len(s) for s in sequences]).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        logits = model.logits(model(ids, pos, cu).last_hidden_state)[0].float()
    return [logits[cu[n] : cu[n + 1]] for n in range(len(sequences))]


def _greedy(decoder, prompts, steps):
    """Greedy continuation -> (tokens [N, steps], logits [N, steps, VOCAB]) from prefill + steps."""
    state = decoder.allocate(len(prompts), max(map(len, prompts)) + steps)
    logits = decoder.prefill(prompts, state, list(range(len(prompts))))
    tokens, all_logits = [], []
    for i in range(steps):
        all_logits.append(logits.float())
        tokens.append(logits.argmax(-1))
        if i + 1 < steps:
            logits = decoder.step(tokens[-1], state)
    return torch.stack(tokens, 1), torch.stack(all_logits, 1)


@pytest.mark.parametrize("make_config", [tiny_qwen3_5_moe_text, tiny_qwen3_moe], ids=["qwen3_5_moe", "qwen3_moe"])
def test_decode_matches_full_forward(make_config):
    """Prefill + one-token steps give the full forward's logits and log-probs of the same tokens."""
    model = _model(make_config())
    tokens, logits = _greedy(MoeDecoder(model), PROMPTS, NEW_TOKENS)
    sequences = [p + tokens[n].tolist() for n, p in enumerate(PROMPTS)]
    full = _full_forward_logits(model, sequences)
    for n, p in enumerate(PROMPTS):
        ref = full[n][len(p) - 1 : len(p) - 1 + NEW_TOKENS]  # logits that predict the new tokens
        assert_rel_rms(f"logits seq {n}", ref, logits[n], 1e-5)
        lp_ref = ref.log_softmax(-1).gather(-1, tokens[n][:, None])
        lp = logits[n].log_softmax(-1).gather(-1, tokens[n][:, None])
        assert (lp - lp_ref).abs().max().item() <= 1e-5
        # greedy decoding picks the full forward's argmax at every position
        assert torch.equal(tokens[n], ref.argmax(-1))


@pytest.mark.parametrize("make_config", [tiny_qwen3_5_moe_text, tiny_qwen3_moe], ids=["qwen3_5_moe", "qwen3_moe"])
def test_joined_projections_keep_the_weights_and_follow_loads(make_config):
    """The decoder joins each layer's projections of one input (`join_projections`): parameter names and values
    stay, each group's weights become consecutive rows of one tensor, and weights loaded afterwards as the rollout
    loads them (copied into the parameters) reach the joined products: the decoder then gives the logits of an
    unjoined model holding those weights."""
    model = _model(make_config())
    before = {name: t.clone() for name, t in model.state_dict().items()}
    decoder = MoeDecoder(model)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)
    groups = [
        [module.get_submodule(name).weight for name in names]
        for module in model.modules()
        for names in getattr(module, "joint_projections", ())
    ]
    assert groups and all(joined_weight(weights) is not None for weights in groups)

    new = _model(make_config())  # a second model of the same weights, then moved away from them
    torch.manual_seed(1)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    load_named_tensors(model, new.state_dict().items())
    tokens, logits = _greedy(decoder, PROMPTS, NEW_TOKENS)
    full = _full_forward_logits(new, [p + tokens[n].tolist() for n, p in enumerate(PROMPTS)])
    for n, p in enumerate(PROMPTS):
        assert_rel_rms(f"logits seq {n}", full[n][len(p) - 1 : len(p) - 1 + NEW_TOKENS], logits[n], 1e-5)


def test_decode_with_the_triton_attention_step_matches_full_forward(monkeypatch):
    """The decode-attention kernel (`attention.decode=triton`, interpreter on CPU) in the decoder's steps:
    the full forward's logits, as with the default op."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("VERL_MOE_OPS", "attention.decode=triton")
    model = _model(tiny_qwen3_5_moe_text())
    decoder = MoeDecoder(model)
    assert model.ops.attention_decode.__name__ == "decode_attention_triton"
    tokens, logits = _greedy(decoder, PROMPTS, NEW_TOKENS)
    full = _full_forward_logits(model, [p + tokens[n].tolist() for n, p in enumerate(PROMPTS)])
    for n, p in enumerate(PROMPTS):
        assert_rel_rms(f"logits seq {n}", full[n][len(p) - 1 : len(p) - 1 + NEW_TOKENS], logits[n], 1e-5)


def _step_pass(decoder, logits, state, active):
    return decoder.step(logits.argmax(-1), state, active)


def _verify_pass(decoder, logits, state, active):
    tokens = torch.stack([logits.argmax(-1), logits.argmin(-1), logits.argmax(-1)], 1)  # [3, T=3]
    return decoder.verify(tokens, state, active)[0]


@pytest.mark.parametrize("decode_pass", [_step_pass, _verify_pass], ids=["step", "verification"])
def test_idle_slots_attention_reads_one_position(monkeypatch, decode_pass):
    """The attention of a step, and of the speculative verification (several positions per slot), reads an idle
    slot's cache at one position only (the decode-attention kernel, whose reads follow each row's count;
    interpreter on CPU): NaN in the rest of the idle slot's cache reaches no output, and the running slots'
    outputs are those of the same pass without the idle slot poisoned."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("VERL_MOE_OPS", "attention.decode=triton")
    model = _model(tiny_qwen3_5_moe_text())
    decoder = MoeDecoder(model)
    state = decoder.allocate(3, 16)
    logits = decoder.prefill(PROMPTS, state, [0, 1, 2])
    active = torch.tensor([True, False, True])
    clean = decode_pass(decoder, logits, copy.deepcopy(state), active)
    for cache in state.layers:
        if hasattr(cache, "k"):
            cache.k[1, :, 1:], cache.v[1, :, 1:] = float("nan"), float("nan")
    poisoned = decode_pass(decoder, logits, state, active)
    assert torch.isfinite(poisoned).all()
    assert torch.equal(poisoned[active], clean[active])


def test_slots_step_independently_of_where_and_when_they_were_filled():
    """Sequences prefilled together into slots 0..2 step as the same sequences prefilled one by one
    into scattered slots of a larger state (idle slots between them, an inactive one among the
    stepped ones), moved down into slots 0..2 and grown to more slots and positions: every slot's
    state follows only its own tokens, and an inactive slot keeps its state and length exactly."""
    model = _model(tiny_qwen3_5_moe_text())
    decoder = MoeDecoder(model)
    together = decoder.allocate(3, 16)
    logits = decoder.prefill(PROMPTS, together, [0, 1, 2])
    tokens = logits.argmax(-1)

    apart = decoder.allocate(6, 12)
    for prompt, slot in zip(PROMPTS, [4, 1, 3]):
        decoder.prefill([prompt], apart, [slot])
    before = [c.recurrent[5].clone() for c in apart.layers if hasattr(c, "recurrent")]
    scattered = torch.zeros(6, dtype=torch.long)
    scattered[[4, 1, 3]] = tokens
    active = torch.tensor([False, True, False, True, True, False])
    step_apart = decoder.step(scattered, apart, active)[[4, 1, 3]]
    step_together = decoder.step(tokens, together)
    assert_rel_rms("scattered slots' step", step_together, step_apart, 1e-6)
    assert apart.lengths.tolist() == [0, 1 + len(PROMPTS[1]), 0, 1 + len(PROMPTS[2]), 1 + len(PROMPTS[0]), 0]
    after = [c.recurrent[5] for c in apart.layers if hasattr(c, "recurrent")]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # the inactive slot kept its state

    apart.move([4, 1, 3], [0, 1, 2])
    apart.resize(8, 20)
    assert apart.capacity == 20 and apart.num_slots == 8 and apart.version == 1
    tokens = step_together.argmax(-1)
    step_moved = decoder.step(torch.cat([tokens, torch.zeros(5, dtype=torch.long)]), apart, torch.arange(8) < 3)
    assert_rel_rms("moved and grown slots' step", decoder.step(tokens, together), step_moved[:3], 1e-6)


@pytest.mark.parametrize("make_config", [tiny_qwen3_5_moe_text, tiny_qwen3_moe], ids=["qwen3_5_moe", "qwen3_moe"])
def test_prefill_in_chunks_continues_the_slot(make_config):
    """A prompt prefilled in chunks (4, then 1: shorter than the conv's W-1, then 4 more), each chunk
    continuing its slot beside a fresh prompt prefilled with it, gives the logits of the whole prompt
    prefilled at once, and the same decode steps after it."""
    model = _model(make_config())
    decoder = MoeDecoder(model)
    prompt, other = PROMPTS[2], PROMPTS[0]
    whole = decoder.allocate(3, 16)
    ref = decoder.prefill([prompt, other], whole, [1, 2])
    chunked = decoder.allocate(3, 16)
    decoder.prefill([prompt[:4]], chunked, [1])
    decoder.prefill([prompt[4:5], other], chunked, [1, 2], starts=[4, 0])
    logits = decoder.prefill([prompt[5:]], chunked, [1], starts=[5])
    assert_rel_rms("chunked prefill logits", ref[0], logits[0], 1e-5)
    assert chunked.lengths.tolist() == whole.lengths.tolist()
    tokens = torch.zeros(3, dtype=torch.long)
    tokens[1:] = ref.argmax(-1)
    active = torch.tensor([False, True, True])
    for _ in range(3):
        step_ref, step = decoder.step(tokens, whole, active), decoder.step(tokens, chunked, active)
        assert_rel_rms("steps after a chunked prefill", step_ref[1:], step[1:], 1e-5)
        tokens = torch.where(active, step_ref.argmax(-1), 0)
    with pytest.raises(ValueError, match="starts must be"):
        decoder.prefill([prompt[:2]], chunked, [1], starts=[-1])
    with pytest.raises(ValueError, match="capacity"):
        decoder.prefill([prompt], chunked, [1], starts=[12])


@pytest.mark.parametrize("make_config", [tiny_qwen3_5_moe_text, tiny_qwen3_moe], ids=["qwen3_5_moe", "qwen3_moe"])
def test_verify_and_commit_equal_one_token_steps(make_config):
    """`verify` of T = 4 tokens per slot gives, at every position, the logits that four one-token steps give
    and leaves the slots' GatedDeltaNet states and lengths as they were; `commit` of kept = 1, 4, 2 positions
    leaves each slot as stepping just those tokens does, and an inactive slot as it was."""
    model = _model(make_config())
    decoder = MoeDecoder(model)
    state = decoder.allocate(4, 24)
    decoder.prefill(PROMPTS, state, [0, 1, 2])
    tokens = torch.tensor([[3, 8, 1, 5], [7, 7, 2, 9], [4, 12, 6, 1], [0, 0, 0, 0]])
    active = torch.tensor([True, True, True, False])
    kept = torch.tensor([1, 4, 2, 3])
    before = copy.deepcopy(state)
    hidden, steps = decoder.verify(tokens, state, active)
    assert torch.equal(state.lengths, before.lengths)
    for ours, old in zip(state.layers, before.layers):
        if isinstance(ours, LinearCache):
            assert torch.equal(ours.conv, old.conv) and torch.equal(ours.recurrent, old.recurrent)
    every, stepped = copy.deepcopy(before), copy.deepcopy(before)
    logits = model.logits(hidden).float()
    for t in range(tokens.shape[1]):
        out = decoder.step(tokens[:, t], every, active).float()
        assert_rel_rms(f"verified position {t}", out[:3], logits[:3, t], 1e-5)
        decoder.step(tokens[:, t], stepped, active & (kept > t))
    decoder.commit(steps, kept, state, active)
    assert state.lengths.tolist() == stepped.lengths.tolist() == [5 + 1, 1 + 4, 9 + 2, 0]
    for ours, ref, old in zip(state.layers, stepped.layers, before.layers):
        for name, a in vars(ours).items():
            b = getattr(ref, name)
            if isinstance(ours, LinearCache):
                assert_rel_rms(name, b[:3], a[:3], 1e-5)
            else:  # the positions below each slot's length are what a step reads
                for slot, n in enumerate(state.lengths.tolist()[:3]):
                    assert_rel_rms(f"{name} of slot {slot}", b[slot, :, :n], a[slot, :, :n], 1e-5)
            assert torch.equal(a[3], getattr(old, name)[3])  # the inactive slot


def test_decode_rejects_bad_inputs():
    decoder = MoeDecoder(_model(tiny_qwen3_moe()))
    state = decoder.allocate(2, 4)
    with pytest.raises(ValueError, match="at least one token"):
        decoder.prefill([[1, 2], []], state, [0, 1])
    with pytest.raises(ValueError, match="token ids"):
        decoder.prefill([[1, 500]], state, [0])
    with pytest.raises(ValueError, match="capacity"):
        decoder.prefill([[1, 2, 3, 4, 5]], state, [0])
    with pytest.raises(ValueError, match="distinct indices"):
        decoder.prefill([[1], [2]], state, [1, 1])
    with pytest.raises(ValueError, match="tokens must be"):
        decoder.step(torch.tensor([1, 2, 3]), state)
    with pytest.raises(ValueError, match="active must be"):
        decoder.step(torch.tensor([1, 2]), state, torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="only grow"):
        state.resize(1, 4)


# ---- step ops ------------------------------------------------------------------------------


def test_conv1d_step_over_sequence_equals_reference():
    """Stepping each token from the prefill state of a prefix equals the full causal conv."""
    gen = torch.Generator().manual_seed(0)
    N, T, C, W, T0 = 3, 7, 10, 4, 2
    x = torch.randn(N, T, C, dtype=torch.float64, generator=gen)
    weight = torch.randn(C, W, dtype=torch.float64, generator=gen)
    bias = torch.randn(C, dtype=torch.float64, generator=gen)
    ref = causal_conv1d_ref(x, weight, bias, activation="silu")
    state = conv1d_state_from_prefill(x[:, :T0], W)  # prefix shorter than W-1: zero padded
    outs = []
    for t in range(T0, T):
        out, state = causal_conv1d_step_ref(x[:, t], state, weight, bias, activation="silu")
        outs.append(out)
    assert_rel_rms("conv step", ref[:, T0:], torch.stack(outs, 1), 1e-12)
    assert torch.equal(state, x[:, T - W + 1 :].transpose(1, 2))


def test_conv1d_state_from_packed_prefill():
    x = torch.arange(1.0, 11.0)[None, :, None].expand(1, 10, 2)
    cu = torch.tensor([0, 1, 6, 10], dtype=torch.int32)
    state = conv1d_state_from_prefill(x, 4, cu)
    assert state[:, 0].tolist() == [[0.0, 0.0, 1.0], [4.0, 5.0, 6.0], [8.0, 9.0, 10.0]]


def _gdn_inputs(N, T, H, HV, K, V, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(N, T, H, K, dtype=dtype, generator=gen)
    k = torch.randn(N, T, H, K, dtype=dtype, generator=gen)
    v = torch.randn(N, T, HV, V, dtype=dtype, generator=gen)
    g = -torch.rand(N, T, HV, dtype=dtype, generator=gen)
    beta = torch.rand(N, T, HV, dtype=dtype, generator=gen)
    s0 = torch.randn(N, HV, K, V, dtype=dtype, generator=gen) * 0.1
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("step", [gated_delta_rule_step, gated_delta_rule_step_ref], ids=["torch", "reference"])
def test_gdn_step_over_sequence_equals_recurrent_reference(step):
    q, k, v, g, beta, s0 = _gdn_inputs(3, 6, 2, 4, 8, 5, torch.float64)
    o_ref, s_ref = recurrent_gated_delta_rule_ref(
        q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    state, outs = s0, []
    for t in range(q.shape[1]):
        o, state = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, use_qk_l2norm_in_kernel=True)
        outs.append(o)
    assert_rel_rms("gdn step o", o_ref, torch.stack(outs, 1), 1e-12)
    assert_rel_rms("gdn step state", s_ref, state, 1e-12)


def test_gdn_step_continues_chunked_prefill():
    """fp32: the state the chunked op leaves after a prompt, stepped on, matches the chunked op
    run over prompt + continuation."""
    q, k, v, g, beta, _ = _gdn_inputs(1, 70, 2, 4, 16, 8, torch.float32)  # 70 > one 64-token chunk
    o_full, _ = chunk_gated_delta_rule_ref(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    _, state = chunk_gated_delta_rule_ref(
        q[:, :66], k[:, :66], v[:, :66], g[:, :66], beta[:, :66], output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    outs = []
    for t in range(66, 70):
        o, state = gated_delta_rule_step(
            q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, use_qk_l2norm_in_kernel=True
        )
        outs.append(o)
    assert_rel_rms("gdn step after chunked prefill", o_full[:, 66:], torch.stack(outs, 1), 1e-5)


def test_step_ops_reject_bad_shapes():
    q, k, v, g, beta, s0 = _gdn_inputs(2, 1, 2, 4, 8, 5, torch.float32)
    with pytest.raises(ValueError, match="state must be"):
        gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0[:1])
    with pytest.raises(ValueError, match="conv_state must be"):
        causal_conv1d_step_ref(torch.zeros(2, 6), torch.zeros(2, 6, 2), torch.zeros(6, 4))


@pytest.mark.parametrize(
    "dtype,tol,l2norm,shape",
    [
        (torch.float32, 1e-6, True, (3, 2, 4, 16, 8)),  # N, H, HV, K, V
        (torch.float32, 1e-6, False, (2, 1, 3, 12, 40)),  # K not a power of two, V over two BV blocks
        (torch.bfloat16, 1e-2, True, (3, 2, 4, 16, 8)),
    ],
)
def test_gdn_step_triton_equals_fp64_reference(dtype, tol, l2norm, shape):
    """The Triton step (interpreter on CPU) vs the fp64 reference, over three tokens (state carried)."""
    from verl_moe.ops.gdn.step_kernel import gated_delta_rule_step_triton

    N, H, HV, K, V = shape
    q, k, v, g, beta, s0 = _gdn_inputs(N, 3, H, HV, K, V, dtype)
    state_ref, state = s0.double(), s0.float()
    for t in range(3):
        args = (q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        o_ref, state_ref = gated_delta_rule_step(*(a.double() for a in args), state_ref, use_qk_l2norm_in_kernel=l2norm)
        o, state = gated_delta_rule_step_triton(*args, state, use_qk_l2norm_in_kernel=l2norm)
        assert o.dtype == dtype and state.dtype == torch.float32
        assert_rel_rms(f"triton step o t={t}", o_ref, o, tol)
    assert_rel_rms("triton step state", state_ref, state, tol)


def test_gdn_step_triton_reads_strided_head_slices():
    """q, k, v handed as head slices of one row tensor (as the decoder splits its conv output: a row stride
    above their width) give bitwise the step of contiguous copies (interpreter on CPU)."""
    from verl_moe.ops.gdn.step_kernel import gated_delta_rule_step_triton

    N, H, HV, K, V = 3, 2, 4, 16, 8
    q, k, v, g, beta, s0 = _gdn_inputs(N, 1, H, HV, K, V, torch.float32)
    row = torch.cat([q[:, 0].flatten(1), k[:, 0].flatten(1), v[:, 0].flatten(1)], 1)  # [N, C]
    qs, ks, vs = row.split([H * K, H * K, HV * V], 1)
    qs, ks, vs = qs.view(N, H, K), ks.view(N, H, K), vs.view(N, HV, V)
    assert qs.stride(0) == row.shape[1] != H * K  # strided rows, read in place
    o_ref, s_ref = gated_delta_rule_step_triton(
        q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0.clone(), use_qk_l2norm_in_kernel=True
    )
    o, s = gated_delta_rule_step_triton(qs, ks, vs, g[:, 0], beta[:, 0], s0.clone(), use_qk_l2norm_in_kernel=True)
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)


def test_gdn_step_triton_does_not_read_idle_rows():
    """An idle row's state is not read (a decode step's state traffic follows the running requests): NaN in the
    idle rows' states reaches neither their output nor any other row, and stays where it was."""
    from verl_moe.ops.gdn.step_kernel import gated_delta_rule_step_triton

    q, k, v, g, beta, s0 = _gdn_inputs(4, 1, 2, 4, 16, 8, torch.float32)
    args = (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    active = torch.tensor([True, False, True, False])
    o_ref, s_ref = gated_delta_rule_step_triton(*args, s0.clone(), use_qk_l2norm_in_kernel=True)
    state = s0.clone()
    state[~active] = float("nan")
    o, _ = gated_delta_rule_step_triton(*args, state, use_qk_l2norm_in_kernel=True, active=active, inplace=True)
    assert torch.isfinite(o).all()
    assert torch.equal(o[active], o_ref[active]) and torch.equal(state[active], s_ref[active])
    assert state[~active].isnan().all()


@pytest.mark.parametrize("impl", ["torch", "reference", "triton"])
def test_gdn_step_in_place_with_inactive_rows(impl):
    """In place with an `active` mask: active rows get the out-of-place step's o and state (bitwise:
    the same operations), inactive rows keep their state bitwise, and the state tensor is the one
    returned."""
    from verl_moe.ops.gdn.step_kernel import gated_delta_rule_step_triton

    step = {"torch": gated_delta_rule_step, "reference": gated_delta_rule_step_ref}.get(impl)
    step = step or gated_delta_rule_step_triton
    q, k, v, g, beta, s0 = _gdn_inputs(4, 1, 2, 4, 16, 8, torch.float32)
    args = (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    o_ref, s_ref = step(*args, s0.clone(), use_qk_l2norm_in_kernel=True)
    active = torch.tensor([True, False, True, False])
    state = s0.clone()
    o, out = step(*args, state, use_qk_l2norm_in_kernel=True, active=active, inplace=True)
    assert out is state
    assert torch.equal(o[active], o_ref[active])
    assert torch.equal(state[active], s_ref[active]) and torch.equal(state[~active], s0[~active])
    o2, new = step(*args, s0.clone(), use_qk_l2norm_in_kernel=True, active=active)  # out of place, masked
    assert torch.equal(new[active], s_ref[active]) and torch.equal(new[~active], s0[~active])
    with pytest.raises(ValueError, match="compute dtype"):
        step(*args, s0.double(), inplace=True)
    with pytest.raises(ValueError, match="active must be"):
        step(*args, s0, active=active[:2])


def _strided_heads(q, k, v):
    """q, k [N, T, H, K], v [N, T, HV, V] as head slices of one [N, T, C] tensor (the decoder's conv output)."""
    N, T = q.shape[:2]
    rows = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], 2)
    qs, ks, vs = rows.split([q[0, 0].numel(), k[0, 0].numel(), v[0, 0].numel()], 2)
    return qs.view(q.shape), ks.view(k.shape), vs.view(v.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_positions_triton_equals_successive_steps_bitwise(dtype):
    """The positions kernel (interpreter on CPU) runs each row's first counts[n] positions from its state as
    that many one-token step-kernel calls do, bitwise (o at those positions, the state it leaves), with q, k, v
    read as strided head slices; without `advance` the state is not written."""
    from verl_moe.ops.gdn.step_kernel import gated_delta_rule_positions_triton, gated_delta_rule_step_triton

    N, T, H, HV, K, V = 5, 3, 2, 4, 16, 40  # V over two BV blocks
    q, k, v, g, beta, s0 = _gdn_inputs(N, T, H, HV, K, V, dtype)
    s0 = s0.float()
    counts = torch.tensor([0, 1, 2, 3, 3])
    state = s0.clone()
    outs = []
    for t in range(T):
        o_t, _ = gated_delta_rule_step_triton(
            q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, None, True, active=counts > t, inplace=True
        )
        outs.append(o_t)
    o_steps = torch.stack(outs, 1)
    qs, ks, vs = _strided_heads(q, k, v)
    assert qs.stride(1) != H * K  # strided positions, read in place
    kept = s0.clone()
    o = gated_delta_rule_positions_triton(qs, ks, vs, g, beta, kept, use_qk_l2norm_in_kernel=True, counts=counts)
    assert torch.equal(kept, s0)  # not advanced: not written
    ran = torch.arange(T)[None] < counts[:, None]
    assert torch.equal(o[ran], o_steps[ran])
    o_adv = gated_delta_rule_positions_triton(qs, ks, vs, g, beta, kept, None, True, counts=counts, advance=True)
    assert torch.equal(o_adv[ran], o_steps[ran]) and torch.equal(kept, state)
    all_t = gated_delta_rule_positions_triton(q, k, v, g, beta, s0.clone(), None, True)  # counts None: every position
    assert torch.equal(all_t[counts == T], o_steps[counts == T])


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_gdn_positions_idle_rows_untouched_and_torch_matches_fp64(impl):
    """A row of 0 positions: NaN in its state reaches no other row and stays, advanced or not; the rows that
    run match the fp64 recurrent reference over their positions (torch form at 1e-12 in fp64, both forms at 1e-6
    in fp32)."""
    from verl_moe.ops.gdn.positions import gated_delta_rule_positions
    from verl_moe.ops.gdn.step_kernel import gated_delta_rule_positions_triton

    positions = {"torch": gated_delta_rule_positions, "triton": gated_delta_rule_positions_triton}[impl]
    N, T, H, HV, K, V = 4, 3, 2, 4, 16, 8
    q, k, v, g, beta, s0 = _gdn_inputs(N, T, H, HV, K, V, torch.float64)
    counts = torch.tensor([3, 0, 2, 3])
    o_ref, s_ref = recurrent_gated_delta_rule_ref(
        q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    _, s_ref2 = recurrent_gated_delta_rule_ref(
        q[:, :2], k[:, :2], v[:, :2], g[:, :2], beta[:, :2], initial_state=s0, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    dtype, tol = (torch.float64, 1e-12) if impl == "torch" else (torch.float32, 1e-6)
    args = [t.to(dtype) for t in (q, k, v, g, beta)]
    state = s0.to(torch.float64 if impl == "torch" else torch.float32)
    state[1] = float("nan")
    o = positions(*args, state, None, True, counts=counts, advance=True)
    full = counts == T
    assert_rel_rms(f"{impl} positions o", o_ref[full], o[full], tol)
    assert_rel_rms(f"{impl} positions o, 2 of 3", o_ref[2, :2], o[2, :2], tol)
    assert_rel_rms(f"{impl} positions state", s_ref[full], state[full], tol)
    assert_rel_rms(f"{impl} positions state, 2 of 3", s_ref2[2], state[2], tol)
    assert torch.isfinite(o[counts > 0]).all() and state[1].isnan().all()
    with pytest.raises(ValueError, match="counts must be"):
        positions(*args, state, counts=counts[:2])


ON_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize(
    "N,C,W,bias,device",
    [
        pytest.param(3, 10, 4, True, "cpu", id="C10-W4"),
        pytest.param(3, 300, 2, False, "cpu", id="C300-W2"),
        pytest.param(256, 8192, 4, False, "cuda", id="decode-step-cuda", marks=ON_CUDA),
    ],
)
def test_conv1d_step_triton_equals_fp64_reference(dtype, tol, N, C, W, bias, device):
    """The Triton conv step (interpreter on CPU; on CUDA at a decode step's shape) vs the fp64 reference
    over three tokens (state carried; C=300 spans several channel blocks with a ragged last one, W=2
    holds a one-column state)."""
    from verl_moe.ops.conv1d.step_kernel import causal_conv1d_step_triton

    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("the interpreter cases run on CPU-only machines")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, C, generator=gen).to(device, dtype)
    weight = torch.randn(C, W, generator=gen).to(device, dtype)
    b = torch.randn(C, generator=gen).to(device, dtype) if bias else None
    state = (torch.randn(N, C, W - 1, generator=gen)).to(device, dtype)
    state_ref = state.double()
    for t in range(3):
        o_ref, state_ref = causal_conv1d_step_ref(
            x[:, t].double(), state_ref, weight.double(), b.double() if bias else None, activation="silu"
        )
        o, state = causal_conv1d_step_triton(x[:, t], state, weight, b, activation="silu")
        assert o.dtype == dtype and state.dtype == dtype
        assert_rel_rms(f"triton conv step o t={t}", o_ref, o, tol)
    assert torch.equal(state.double(), state_ref)  # the state holds inputs as they were: no arithmetic


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_conv1d_step_in_place_with_inactive_rows(impl):
    """In place with an `active` mask: active rows get the out-of-place step's output and state
    (bitwise: the same operations), inactive rows keep their state bitwise, the state tensor is the
    one returned."""
    from verl_moe.ops.conv1d.step_kernel import causal_conv1d_step_triton

    step = causal_conv1d_step_ref if impl == "torch" else causal_conv1d_step_triton
    gen = torch.Generator().manual_seed(1)
    x, weight = torch.randn(4, 12, generator=gen), torch.randn(12, 4, generator=gen)
    s0 = torch.randn(4, 12, 3, generator=gen)
    o_ref, s_ref = step(x, s0.clone(), weight)
    active = torch.tensor([True, False, True, False])
    state = s0.clone()
    o, out = step(x, state, weight, active=active, inplace=True)
    assert out is state
    assert torch.equal(o[active], o_ref[active])
    assert torch.equal(state[active], s_ref[active]) and torch.equal(state[~active], s0[~active])
    _, new = step(x, s0.clone(), weight, active=active)  # out of place, masked
    assert torch.equal(new[active], s_ref[active]) and torch.equal(new[~active], s0[~active])
    with pytest.raises(ValueError, match="active must be"):
        step(x, s0, weight, active=active[:2])
