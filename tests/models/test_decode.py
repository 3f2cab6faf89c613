"""Decoding (`models/decode.py`) and its step ops against the full forward and the references.

Tolerances:
| what                                                    | dtype | measure        | tol   |
| decode log-probs / logits vs packed full forward        | fp32  | max abs / rel  | 1e-5  |
| conv1d step over a sequence vs causal_conv1d_ref        | fp64  | rel RMS        | 1e-12 |
| gdn step (torch) over a sequence vs recurrent reference | fp64  | rel RMS        | 1e-12 |
| gdn step state after a sequence vs chunked reference    | fp32  | rel RMS        | 1e-5  |
"""

import pytest
import torch
import verl_moe.models as vm
from tiny_models import randomize_norms, tiny_qwen3_5_moe_text, tiny_qwen3_moe
from verl_moe.models.decode import DecodeState, MoeDecoder
from verl_moe.ops.conv1d import causal_conv1d_ref
from verl_moe.ops.conv1d.step import causal_conv1d_step_ref, conv1d_state_from_prefill
from verl_moe.ops.gdn import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref
from verl_moe.ops.gdn.step import gated_delta_rule_step, gated_delta_rule_step_ref
from verl_moe.ops.testing import assert_rel_rms

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
    logits, state = decoder.prefill(prompts, capacity=max(map(len, prompts)) + steps)
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


def test_decode_state_select_and_concat():
    """Sequences prefilled apart, then joined (KV caches of different capacity) and reordered, step
    exactly as when prefilled together."""
    model = _model(tiny_qwen3_5_moe_text())
    decoder = MoeDecoder(model)
    logits_all, together = decoder.prefill(PROMPTS, capacity=16)
    _, a = decoder.prefill(PROMPTS[:1], capacity=6)
    _, b = decoder.prefill(PROMPTS[1:], capacity=12)
    joined = DecodeState.concat([b, a]).select([2, 0, 1])  # back to PROMPTS order
    tokens = logits_all.argmax(-1)
    step_together = decoder.step(tokens, together)
    step_joined = decoder.step(tokens, joined)
    assert_rel_rms("joined step", step_together, step_joined, 1e-6)
    assert torch.equal(together.lengths, joined.lengths)


def test_decode_rejects_bad_inputs():
    decoder = MoeDecoder(_model(tiny_qwen3_moe()))
    with pytest.raises(ValueError, match="at least one token"):
        decoder.prefill([[1, 2], []])
    with pytest.raises(ValueError, match="token ids"):
        decoder.prefill([[1, 500]])
    _, state = decoder.prefill([[1, 2]])
    with pytest.raises(ValueError, match="tokens must be"):
        decoder.step(torch.tensor([1, 2]), state)


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
