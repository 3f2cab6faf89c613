"""Exact mode's op forms (`ops/*/exact.py`, `ops/exact.py`) against the fp64 references, and their rows'
independence from the rest of the call.

Tolerances (rel RMS against the reference run in fp64 on the same inputs):
| op                                  | dtype | tol  |
| linear_rows, attention, gdn, conv1d | fp32  | 1e-5 |
| experts, logprob head               | fp32  | 1e-5 |
| gradients (the fast form's)         | fp32  | 1e-5 |
"""

import pytest
import torch
from verl_moe.ops.attention import causal_attention_ref
from verl_moe.ops.attention.exact import causal_attention_exact, decode_attention_exact
from verl_moe.ops.compare import assert_rel_rms
from verl_moe.ops.conv1d import causal_conv1d_ref
from verl_moe.ops.conv1d.exact import causal_conv1d_exact
from verl_moe.ops.experts import moe_experts_ref
from verl_moe.ops.experts.exact import moe_experts_exact
from verl_moe.ops.gdn import chunk_gated_delta_rule_ref
from verl_moe.ops.gdn.exact import gated_delta_rule_step_exact, recurrent_gated_delta_rule_exact
from verl_moe.ops.linear.exact import linear_exact, linear_rows
from verl_moe.ops.logprob import logprobs_and_entropy

CU = [0, 5, 6, 23, 40]  # a 1-token sequence, lengths past one attention tile


def _f64(*ts):
    return [t.double() for t in ts]


def test_linear_rows_is_the_product_and_ignores_the_other_rows():
    torch.manual_seed(0)
    x, w, b = torch.randn(37, 24), torch.randn(40, 24), torch.randn(40)
    out = linear_rows(x, w, b)
    assert_rel_rms("linear", (x.double() @ w.double().T + b.double()), out, 1e-6)
    for rows in (slice(0, 1), slice(3, 4), slice(5, 30)):
        assert torch.equal(linear_rows(x[rows], w, b), out[rows])


def test_exact_forms_gradients_are_the_fast_forms():
    """exact_forward: the forward is the exact form, the gradient the fast form's at the same inputs."""
    torch.manual_seed(0)
    x, w = torch.randn(9, 16, requires_grad=True), torch.randn(8, 16, requires_grad=True)
    g = torch.randn(9, 8)
    linear_exact(x, w).backward(g)
    assert torch.allclose(x.grad, g @ w.detach()) and torch.allclose(w.grad, g.T @ x.detach())


def test_attention_exact_matches_reference_and_decode():
    torch.manual_seed(0)
    T, H, HKV, K = CU[-1], 4, 2, 16
    q, k, v = torch.randn(1, T, H, K), torch.randn(1, T, HKV, K), torch.randn(1, T, HKV, K)
    cu = torch.tensor(CU, dtype=torch.int32)
    ref = causal_attention_ref(*_f64(q, k, v), cu_seqlens=cu)
    out = causal_attention_exact(q, k, v, cu_seqlens=cu)
    assert_rel_rms("attention", ref, out, 1e-5)
    # the last token of each sequence as a decode step over a cache holding the sequence: the same bits
    caches = torch.zeros(2, len(CU) - 1, HKV, 64, K)
    for n, (a, b) in enumerate(zip(CU[:-1], CU[1:])):
        caches[0, n, :, : b - a], caches[1, n, :, : b - a] = k[0, a:b].transpose(0, 1), v[0, a:b].transpose(0, 1)
    last = torch.tensor(CU[1:]) - 1
    counts = torch.tensor([b - a for a, b in zip(CU[:-1], CU[1:])])
    step = decode_attention_exact(q[0, last], caches[0], caches[1], counts, K**-0.5)
    # bitwise: the elementwise passes cover whole vectors (rows x 64 values), so no loop tail rounds apart
    assert torch.equal(step, out[0, last])
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    causal_attention_exact(qg, kg, vg, cu_seqlens=cu).sum().backward()
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    causal_attention_ref(qr, kr, vr, cu_seqlens=cu).sum().backward()
    for a, b in ((qg, qr), (kg, kr), (vg, vr)):
        assert_rel_rms("attention grad", b.grad, a.grad, 1e-5)


def test_gdn_exact_matches_reference_and_its_step():
    torch.manual_seed(0)
    T, H, HV, K, V = CU[-1], 2, 4, 16, 8
    q, k = torch.randn(1, T, H, K), torch.randn(1, T, H, K)
    v, g, beta = torch.randn(1, T, HV, V), -torch.rand(1, T, HV), torch.rand(1, T, HV)
    h0 = torch.randn(len(CU) - 1, HV, K, V)
    cu = torch.tensor(CU, dtype=torch.int32)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    ref_o, ref_s = chunk_gated_delta_rule_ref(*_f64(q, k, v, g, beta), **{**kw, "initial_state": h0.double()})
    o, s = recurrent_gated_delta_rule_exact(q, k, v, g, beta, **kw)
    assert_rel_rms("gdn o", ref_o, o, 1e-5)
    assert_rel_rms("gdn state", ref_s, s, 1e-5)
    # the first sequence by steps: the packed form's values (bitwise only with torch's scalar cpu kernels,
    # which the end-to-end test runs: the exp of the decay rounds by the loop's layout otherwise)
    state = h0[:1].clone()
    for t in range(CU[1]):
        o_t, state = gated_delta_rule_step_exact(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, None, True)
        assert_rel_rms(f"gdn step {t}", o[:, t], o_t, 1e-6)
    assert_rel_rms("gdn step state", s[:1], state, 1e-6)


def test_conv1d_exact_matches_reference():
    torch.manual_seed(0)
    x, w = torch.randn(1, CU[-1], 12), torch.randn(12, 4)
    cu = torch.tensor(CU, dtype=torch.int32)
    ref = causal_conv1d_ref(*_f64(x, w), cu_seqlens=cu)
    assert_rel_rms("conv1d", ref, causal_conv1d_exact(x, w, cu_seqlens=cu), 1e-6)


def test_experts_exact_matches_reference():
    torch.manual_seed(0)
    N, D, I, E = 30, 16, 8, 4
    x, gu, dn = torch.randn(N, D), torch.randn(E, 2 * I, D) / 4, torch.randn(E, D, I) / 4
    idx = torch.stack([torch.randperm(E)[:2] for _ in range(N)])
    wt = torch.rand(N, 2)
    out = moe_experts_exact(x, gu, dn, idx, wt)
    assert_rel_rms("experts", moe_experts_ref(*_f64(x, gu, dn), idx, wt.double()), out, 1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprob_exact_matches_reference(temperature):
    torch.manual_seed(0)
    h, w = torch.randn(20, 16), torch.randn(50, 16)
    labels = torch.randint(0, 50, (20,))
    ref_lp, ref_ent = logprobs_and_entropy(h.double(), w.double(), labels, temperature, impl="torch")
    lp, ent = logprobs_and_entropy(h, w, labels, temperature, impl="exact")
    assert_rel_rms("log_prob", ref_lp, lp, 1e-5)
    assert_rel_rms("entropy", ref_ent, ent, 1e-5)


def test_tiles_agree_compares_each_config_once_and_not_while_capturing(monkeypatch):
    """`tiles_agree` is true only for bitwise-equal outputs, probes a key once, and during a graph capture
    answers false without probing or remembering."""
    from verl_moe.ops import device, exact

    calls = []

    def probe(*outs):
        def outputs():
            calls.append(1)
            return [torch.tensor(v) for v in outs]

        return outputs

    monkeypatch.setattr(exact, "_TILES_AGREE", {})
    assert exact.tiles_agree(("same",), probe(1.0, 1.0, 1.0))
    assert exact.tiles_agree(("same",), probe(1.0, 2.0))  # remembered: not probed again
    assert len(calls) == 1
    assert not exact.tiles_agree(("one ulp",), probe(1.0, float(torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)))))
    monkeypatch.setattr(device, "capturing", lambda: True)
    assert not exact.tiles_agree(("captured",), probe(1.0, 1.0))
    assert len(calls) == 2 and ("captured",) not in exact._TILES_AGREE
