"""logprobs_and_entropy (chunked torch path, Triton path) against the fp64 full-logits reference.

Tolerances, against the reference run in fp64 on the same (bf16-rounded where bf16) values:
| output                | fp32                               | bf16             |
| log_prob, entropy     | max abs <= 2e-5 * (1 + max|logit|) | max abs <= 2e-2  |
| d_hidden, d_weight    | rel RMS <= 1e-5                    | rel RMS <= 1e-2  |
Gradients are of loss = sum(a * log_prob) + sum(b * entropy) with random per-token a, b.

The Triton kernels run on CPU under TRITON_INTERPRET=1, which must be set before triton is
imported and stays read at launch: `test_triton_path_in_interpreter` reruns this file in a child
pytest with the variable set, where IMPLS is ["triton"], so no other test module sees it. On a GPU
the `gpu` tests repeat the comparison at the Qwen3.5 shape (N=16384, D=2048, VOCAB=248320, bf16).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch
from verl_moe.ops import device
from verl_moe.ops.compare import assert_rel_rms
from verl_moe.ops.logprob import LogprobOptions, logprobs_and_entropy, logprobs_and_entropy_ref

GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
BF16_ABS = 2e-2
_CHILD_FLAG = "VERL_MOE_TEST_LOGPROB_INTERPRETER"
IN_CHILD = os.environ.get(_CHILD_FLAG) == "1"
IMPLS = ["triton"] if IN_CHILD else ["torch"]
DTYPES = [torch.float32, torch.bfloat16]


def _call(impl, hidden, weight, labels, temperature=1.0, calculate_entropy=True, entropy_grad=True, options=None):
    return logprobs_and_entropy(
        hidden, weight, labels, temperature, calculate_entropy, entropy_grad, impl=impl, options=options
    )


if not IN_CHILD:

    def test_triton_path_in_interpreter():
        """The Triton-path tests of this file, in a child process with TRITON_INTERPRET=1."""
        env = {**os.environ, "TRITON_INTERPRET": "1", _CHILD_FLAG: "1"}
        cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-m", "not gpu"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
        assert " passed" in proc.stdout


def _inputs(case, dtype, n=67, d=40, vocab=300):
    """Leaf inputs for one edge case; labels hit 0 and VOCAB-1."""
    hidden = torch.randn(n, d)
    weight = torch.randn(vocab, d) * 0.5
    temperature = torch.rand(n) + 0.5
    if case == "all_negative":  # every logit < 0
        hidden, weight, temperature = hidden.abs(), -weight.abs() - 0.1, 0.7
    elif case == "huge":  # |logit| ~ 1e4
        hidden = hidden * 2000 / d**0.5
    elif case == "scalar_t":
        temperature = 1.3
    labels = torch.randint(0, vocab, (n,))
    if n:
        labels[0], labels[-1] = 0, vocab - 1
    return hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_(), labels, temperature


def _golden(hidden, weight, labels, temperature, a, b, calculate_entropy=True, entropy_grad=True):
    """fp64 reference outputs and gradients of sum(a * lp) + sum(b * H) on the same values."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    t = temperature.double() if isinstance(temperature, torch.Tensor) else temperature
    lp, ent = logprobs_and_entropy_ref(h, w, labels, t, calculate_entropy, dtype=torch.float64)
    loss = (a.double() * lp).sum()
    if calculate_entropy and entropy_grad:
        loss = loss + (b.double() * ent).sum()
    dh, dw = torch.autograd.grad(loss, [h, w])
    max_logit = (h @ w.t()).abs().max().item()
    return lp.detach(), None if ent is None else ent.detach(), dh, dw, max_logit


def _check(name, dtype, got, ref, max_logit):
    tol = 2e-5 * (1 + max_logit) if dtype == torch.float32 else BF16_ABS
    assert got.dtype == torch.float32 and torch.isfinite(got).all(), name
    err = (got.double() - ref).abs().max().item()
    assert err <= tol, f"{name}: max |diff| {err:.3e} > {tol:.3e}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["per_token_t", "scalar_t", "all_negative", "huge"])
def test_matches_fp64_reference(impl, dtype, case, nan_poison):
    hidden, weight, labels, temperature = _inputs(case, dtype)
    a, b = torch.randn(hidden.shape[0]), torch.randn(hidden.shape[0])
    # a 128-column vocab chunk: 3 chunks for VOCAB=300, the last one partial
    options = LogprobOptions(chunk_elems=hidden.shape[0] * 128)
    lp, ent = _call(impl, hidden, weight, labels, temperature, options=options)
    ((a * lp).sum() + (b * ent).sum()).backward()
    lp_ref, ent_ref, dh_ref, dw_ref, max_logit = _golden(hidden, weight, labels, temperature, a, b)
    _check("log_prob", dtype, lp, lp_ref, max_logit)
    _check("entropy", dtype, ent, ent_ref, max_logit)
    assert (lp <= 0).all() and (ent >= 0).all()
    assert_rel_rms("d_hidden", dh_ref, hidden.grad, GRAD_TOL[dtype])
    assert_rel_rms("d_weight", dw_ref, weight.grad, GRAD_TOL[dtype])
    assert hidden.grad.dtype == dtype and weight.grad.dtype == dtype


if IN_CHILD:

    @pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
    def test_triton_multi_tile_paths(dtype, monkeypatch, nan_poison):
        """Several token tiles, splits of several vocab blocks, and programs that loop over work items."""
        from verl_moe.ops.common import launch
        from verl_moe.ops.logprob import fused

        monkeypatch.setattr(fused, "FWD_TARGET_ITEMS", 4)  # 3 token tiles x 2 splits (2 + 1 blocks)
        monkeypatch.setattr(launch, "GRID_LIMIT", 2)  # each program walks several items / tiles
        hidden, weight, labels, temperature = _inputs("per_token_t", dtype, n=300, d=72, vocab=330)
        a, b = torch.randn(300), torch.randn(300)
        lp, ent = _call("triton", hidden, weight, labels, temperature)
        ((a * lp).sum() + (b * ent).sum()).backward()
        lp_ref, ent_ref, dh_ref, dw_ref, max_logit = _golden(hidden, weight, labels, temperature, a, b)
        _check("log_prob", dtype, lp, lp_ref, max_logit)
        _check("entropy", dtype, ent, ent_ref, max_logit)
        assert_rel_rms("d_hidden", dh_ref, hidden.grad, GRAD_TOL[dtype])
        assert_rel_rms("d_weight", dw_ref, weight.grad, GRAD_TOL[dtype])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["entropy_grad_false", "no_entropy"])
def test_log_prob_only_gradients(impl, mode):
    """entropy_grad=False: entropy is returned without a graph; grads are those of the log-prob term."""
    hidden, weight, labels, temperature = _inputs("per_token_t", torch.float32)
    a = torch.randn(hidden.shape[0])
    calc = mode == "entropy_grad_false"
    lp, ent = _call(impl, hidden, weight, labels, temperature, calculate_entropy=calc, entropy_grad=False)
    if calc:
        assert not ent.requires_grad and ent.grad_fn is None
    else:
        assert ent is None
    (a * lp).sum().backward()
    lp_ref, ent_ref, dh_ref, dw_ref, max_logit = _golden(
        hidden, weight, labels, temperature, a, None, calculate_entropy=calc, entropy_grad=False
    )
    _check("log_prob", torch.float32, lp, lp_ref, max_logit)
    if calc:
        _check("entropy", torch.float32, ent, ent_ref, max_logit)
    assert_rel_rms("d_hidden", dh_ref, hidden.grad, GRAD_TOL[torch.float32])
    assert_rel_rms("d_weight", dw_ref, weight.grad, GRAD_TOL[torch.float32])


@pytest.mark.parametrize("impl", IMPLS)
def test_inputs_never_modified(impl):
    hidden, weight, labels, temperature = _inputs("per_token_t", torch.bfloat16)
    before = [t.detach().clone() for t in (hidden, weight, labels, temperature)]
    lp, ent = _call(impl, hidden, weight, labels, temperature, options=LogprobOptions(chunk_elems=1))
    (lp.sum() + ent.sum()).backward()
    for old, new in zip(before, (hidden, weight, labels, temperature)):
        assert torch.equal(old, new.detach())


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_batch(impl):
    hidden, weight, labels, _ = _inputs("scalar_t", torch.float32, n=0)
    lp, ent = _call(impl, hidden, weight, labels)
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert hidden.grad.shape == (0, 40) and torch.equal(weight.grad, torch.zeros_like(weight))


@pytest.mark.parametrize("impl", IMPLS)
def test_weight_grad_only_and_no_grad(impl):
    """Only the weight needs a gradient; under no_grad nothing is recorded and values are the same."""
    hidden, weight, labels, temperature = _inputs("per_token_t", torch.float32)
    hidden = hidden.detach()
    lp, ent = _call(impl, hidden, weight, labels, temperature)
    (lp.sum() + ent.sum()).backward()
    assert hidden.grad is None and torch.isfinite(weight.grad).all()
    with torch.no_grad():
        lp2, ent2 = _call(impl, hidden, weight, labels, temperature)
    assert lp2.grad_fn is None and torch.equal(lp2, lp.detach()) and torch.equal(ent2, ent.detach())


def _bad(case):
    hidden, weight, labels, temperature = torch.randn(5, 8), torch.randn(11, 8), torch.randint(0, 11, (5,)), 1.0
    if case == "hidden_3d":
        hidden = hidden[None]
    elif case == "d_mismatch":
        weight = torch.randn(11, 9)
    elif case == "labels_len":
        labels = labels[:4]
    elif case == "label_negative":
        labels[2] = -1
    elif case == "label_vocab":
        labels[2] = 11
    elif case == "dtype_mismatch":
        weight = weight.bfloat16()
    elif case == "labels_int32":
        labels = labels.int()
    elif case == "t_zero":
        temperature = 0.0
    elif case == "t_negative_token":
        temperature = torch.ones(5)
        temperature[3] = -0.5
    elif case == "t_nan":
        temperature = float("nan")
    elif case == "t_shape":
        temperature = torch.ones(4)
    return hidden, weight, labels, temperature


@pytest.mark.parametrize(
    "case",
    [
        "hidden_3d",
        "d_mismatch",
        "labels_len",
        "label_negative",
        "label_vocab",
        "dtype_mismatch",
        "labels_int32",
        "t_zero",
        "t_negative_token",
        "t_nan",
        "t_shape",
    ],
)
def test_bad_inputs_raise_value_error(case):
    with pytest.raises(ValueError):
        logprobs_and_entropy(*_bad(case), impl="torch")


def test_unknown_impl_raises():
    with pytest.raises(ValueError, match="no implementation"):
        logprobs_and_entropy(*_bad("none"), impl="cuda-magic")


# ---- GPU: the Qwen3.5 LM head shape ---------------------------------------------------------


@functools.cache
def _full_size_case():
    """bf16 inputs at N=16384, D=2048, VOCAB=248320 and their fp64 golden (chunked over tokens)."""
    dev = device.current_device()
    gen = torch.Generator(device="cpu").manual_seed(0)
    n, d, vocab = 16384, 2048, 248320
    hidden = torch.randn(n, d, generator=gen).to(dev, torch.bfloat16)
    weight = (torch.randn(vocab, d, generator=gen) * 0.02).to(dev, torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), generator=gen).to(dev)
    temperature = (torch.rand(n, generator=gen) + 0.5).to(dev)
    a, b = torch.randn(n, generator=gen).to(dev), torch.randn(n, generator=gen).to(dev)
    w64 = weight.double().requires_grad_()
    lp, ent, dh = [], [], []
    for s in range(0, n, 1024):  # rows are independent: 1024 tokens of fp64 logits at a time
        h64 = hidden[s : s + 1024].double().requires_grad_()
        lp_c, ent_c = logprobs_and_entropy_ref(h64, w64, labels[s : s + 1024], temperature[s : s + 1024].double())
        loss = (a[s : s + 1024].double() * lp_c).sum() + (b[s : s + 1024].double() * ent_c).sum()
        loss.backward()
        lp.append(lp_c.detach())
        ent.append(ent_c.detach())
        dh.append(h64.grad)
    golden = (torch.cat(lp), torch.cat(ent), torch.cat(dh), w64.grad)
    return (hidden, weight, labels, temperature, a, b), golden


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_full_size_bf16_matches_fp64(impl):
    (hidden, weight, labels, temperature, a, b), (lp_ref, ent_ref, dh_ref, dw_ref) = _full_size_case()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    device.synchronize()
    base = device.memory_stats()["allocated_gib"]
    device.reset_peak_memory_stats()
    lp, ent = logprobs_and_entropy(h, w, labels, temperature, impl=impl)
    ((a * lp).sum() + (b * ent).sum()).backward()
    device.synchronize()
    extra = device.max_memory_allocated() / 1024**3 - base
    _check("log_prob", torch.bfloat16, lp, lp_ref, 0.0)
    _check("entropy", torch.bfloat16, ent, ent_ref, 0.0)
    assert (lp <= 0).all() and (ent >= 0).all()
    assert_rel_rms("d_hidden", dh_ref, h.grad, GRAD_TOL[torch.bfloat16])
    assert_rel_rms("d_weight", dw_ref, w.grad, GRAD_TOL[torch.bfloat16])
    # the gradients themselves (~1 GiB) plus a working set well under one fp32 [N, VOCAB] (15 GiB)
    grads = (h.numel() + w.numel()) * 2 / 1024**3
    print(f"{impl}: peak above inputs {extra:.2f} GiB (gradients {grads:.2f} GiB)")
    assert extra <= grads + 1.5
