"""Router: fp64 golden, transformers' routers, the router dtype, the load-balancing loss, and the
Triton router (softmax / top-k / renorm kernel) against the torch router and the fp64 one.

Tolerances:
| quantity                                  | tol                      |
| logits / topk_weight fp32 vs fp64         | rel RMS 1e-6             |
| vs transformers' TopKRouter (fp32 model)  | rel RMS 1e-6, same ids   |
| aux loss vs textbook fp64 loop            | 1e-6 relative            |
| Triton vs torch router, fp32              | same ids, weights 1e-6 abs |
| Triton gradients vs fp64: fp32 / bf16     | rel RMS 1e-5 / 1e-2      |
| bf16 hidden: fp32 top-k sets = fp64 sets  | >= 99.9% of tokens       |
"""

import pytest
import torch
from transformers import Qwen3_5MoeTextConfig, Qwen3MoeConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter, load_balancing_loss_func
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
from verl_moe.ops import device
from verl_moe.ops.compare import assert_rel_rms, rel_rms
from verl_moe.ops.router import load_balancing_loss, route, route_ref
from verl_moe.ops.router.topk import route_triton, router_topk_bwd, router_topk_fwd

N, D, E, TOPK = 64, 32, 8, 2


def textbook_aux_loss(layers, top_k, num_experts, mask=None):
    """Switch/GShard: per layer E * sum_e f_e P_e, f_e = share of (valid) tokens with e in their top-k,
    P_e = mean softmax probability of e; mean over layers. Explicit fp64 loops."""
    losses = []
    for logits in layers:
        logits = logits.double()
        valid = [n for n in range(logits.shape[0]) if mask is None or mask[n]]
        f = torch.zeros(num_experts, dtype=torch.float64)
        P = torch.zeros(num_experts, dtype=torch.float64)
        for n in valid:
            p = torch.exp(logits[n] - logits[n].max())
            p = p / p.sum()
            P += p / len(valid)
            for e in sorted(range(num_experts), key=lambda e: -p[e].item())[:top_k]:
                f[e] += 1.0 / len(valid)
        losses.append(num_experts * float((f * P).sum()))
    return sum(losses) / len(losses)


@pytest.mark.parametrize("norm", [True, False], ids=["renorm", "raw"])
def test_fp32_matches_fp64(norm):
    h, w = torch.randn(N, D), torch.randn(E, D)
    logits, tw, ti = route(h, w, TOPK, norm)
    l64, tw64, ti64 = route(h.double(), w.double(), TOPK, norm, dtype=torch.float64)
    assert logits.dtype == tw.dtype == torch.float32 and ti.dtype == torch.int64
    assert_rel_rms("logits", l64, logits, 1e-6)
    assert torch.equal(ti, ti64)
    assert_rel_rms("topk_weight", tw64, tw, 1e-6)
    if norm:
        assert torch.allclose(tw.sum(-1), torch.ones(N))


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe_renorm", "qwen3_moe_raw"])
def test_matches_transformers_router(family):
    if family == "qwen3_5_moe":
        hf, norm = (
            Qwen3_5MoeTopKRouter(Qwen3_5MoeTextConfig(hidden_size=D, num_experts=E, num_experts_per_tok=TOPK)),
            True,
        )
    else:
        norm = family.endswith("renorm")
        hf = Qwen3MoeTopKRouter(
            Qwen3MoeConfig(hidden_size=D, num_experts=E, num_experts_per_tok=TOPK, norm_topk_prob=norm)
        )
    with torch.no_grad():
        hf.weight.normal_()
    h = torch.randn(N, D)
    logits, tw, ti = route(h, hf.weight, TOPK, norm)
    l_hf, tw_hf, ti_hf = hf(h)
    assert torch.equal(ti, ti_hf)
    assert_rel_rms("logits", l_hf, logits, 1e-6)
    assert_rel_rms("topk_weight", tw_hf, tw, 1e-6)


def test_router_dtype_fp32_for_bf16_model():
    """fp32 routing of bf16 activations: fp32 outputs, logits exactly the fp32 GEMM of the bf16 values,
    closer to the fp64 golden than routing in bf16."""
    h, w = torch.randn(N, D).bfloat16(), torch.randn(E, D).bfloat16()
    l32, tw32, _ = route(h, w, TOPK, True)
    l16, tw16, _ = route(h, w, TOPK, True, dtype=torch.bfloat16)
    l64, _, _ = route(h, w, TOPK, True, dtype=torch.float64)
    assert l32.dtype == tw32.dtype == torch.float32 and l16.dtype == tw16.dtype == torch.bfloat16
    assert torch.equal(l32, h.float() @ w.float().T)
    assert rel_rms(l64, l32) < 1e-6 < rel_rms(l64, l16)


def test_aux_loss_is_textbook_single_softmax():
    layers = [torch.randn(N, E) * 2 for _ in range(3)]
    ours = load_balancing_loss(layers, TOPK, E)
    assert abs(ours.item() - textbook_aux_loss(layers, TOPK, E)) < 1e-6 * textbook_aux_loss(layers, TOPK, E)
    mask = torch.rand(N) > 0.3
    masked = load_balancing_loss(layers, TOPK, E, token_mask=mask)
    assert abs(masked.item() - textbook_aux_loss(layers, TOPK, E, mask)) < 1e-6
    # one layer: transformers' function (fed raw logits, as its models record them) agrees
    hf = load_balancing_loss_func((layers[0],), E, TOPK)
    assert abs(hf.item() - load_balancing_loss(layers[0], TOPK, E).item()) < 1e-6
    # a second softmax (feeding probabilities) gives a different, flattened value
    double = load_balancing_loss(torch.softmax(layers[0], -1), TOPK, E)
    assert abs(double.item() - load_balancing_loss(layers[0], TOPK, E).item()) > 1e-3


def test_aux_loss_gradient_reaches_logits():
    logits = (torch.randn(N, E) * 2).requires_grad_()
    load_balancing_loss(logits, TOPK, E).backward()
    assert logits.grad.abs().sum() > 0


def test_bad_inputs_raise():
    h, w = torch.randn(N, D), torch.randn(E, D)
    with pytest.raises(ValueError, match="top_k"):
        route(h, w, E + 1, True)
    with pytest.raises(ValueError, match=r"\[N, D\]"):
        route(h, w[:, :-1], TOPK, True)
    with pytest.raises(ValueError, match="floating"):
        route(h, w, TOPK, True, dtype=torch.int32)
    with pytest.raises(ValueError, match="token_mask"):
        load_balancing_loss(torch.randn(N, E), TOPK, E, token_mask=torch.ones(N - 1))
    with pytest.raises(ValueError, match=r"\[N, E=8\]"):
        load_balancing_loss(torch.randn(N, E + 1), TOPK, E)


# --- the Triton router (interpreter on CPU) ---

DEV = device.current_device()


def _router_inputs(N, D, E, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, D, generator=g).to(DEV, dtype), torch.randn(E, D, generator=g).to(DEV, dtype)


@pytest.mark.parametrize(
    "N,E,top_k,norm",
    [(37, 8, 2, True), (20, 33, 5, False), (9, 512, 16, True), (1, 4, 4, True), (16, 64, 1, False)],
    ids=["E8-k2", "E33-k5-raw", "E512-k16", "N1-k=E", "k1-raw"],
)
def test_triton_matches_torch_router(nan_poison, N, E, top_k, norm):
    """Same expert ids bit for bit, same logits, weights within 1e-6; renormalised weights sum to 1."""
    h, w = _router_inputs(N, 24, E)
    logits, tw, ti = route_triton(h, w, top_k, norm)
    l_ref, tw_ref, ti_ref = route_ref(h, w, top_k, norm)
    assert logits.dtype == tw.dtype == torch.float32 and ti.dtype == torch.int64
    assert torch.equal(ti, ti_ref)
    assert torch.equal(logits, l_ref) if DEV.type == "cpu" else rel_rms(l_ref, logits) < 1e-6
    assert (tw - tw_ref).abs().max().item() <= 1e-6
    if norm:
        assert (tw.sum(-1) - 1).abs().max().item() <= 1e-6


def test_triton_ties_take_the_lower_expert_first():
    """Experts 1 and 5 share a gate row (equal logits): the lower id comes first, weights as the torch
    router's (equal values, whatever order torch.topk returns them in)."""
    h, w = _router_inputs(12, 16, 8)
    w[5] = w[1]
    w[6] = -10 * w[1]
    _, tw, ti = route_triton(h, w, 4, True)
    _, tw_ref, _ = route_ref(h, w, 4, True)
    probs = torch.softmax(h.float() @ w.float().T, -1)
    expected = torch.sort(-probs, dim=-1, stable=True).indices[:, :4]
    assert torch.equal(ti, expected)
    assert (tw - tw_ref).abs().max().item() <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("norm", [True, False], ids=["renorm", "raw"])
def test_triton_gradients_match_fp64(dtype, norm):
    """d hidden and d gate_weight of a loss on the combine weights plus the load-balancing loss on the
    logits (the two ways the router's outputs are used) against the fp64 router; in bf16 the error is
    that of rounding the exact gradient to bf16 (the GEMM backward keeps fp32 accuracy)."""
    N, D, E, top_k = 40, 24, 16, 4
    h, w = _router_inputs(N, D, E, dtype)
    dtw = torch.randn(N, top_k, device=DEV)

    def loss(route_fn, hh, ww, cd):
        logits, tw, _ = route_fn(hh, ww, top_k, norm, dtype=cd)
        return (tw * dtw.to(cd)).sum() + load_balancing_loss(logits, top_k, E)

    ref_args = [t.double().requires_grad_() for t in (h, w)]
    ref = torch.autograd.grad(loss(route_ref, *ref_args, torch.float64), ref_args)
    args = [t.clone().requires_grad_() for t in (h, w)]
    got = torch.autograd.grad(loss(route_triton, *args, torch.float32), args)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, r, g in zip(("dhidden", "dgate_weight"), ref, got):
        assert g.dtype == dtype
        assert_rel_rms(name, r, g, tol)
        if dtype == torch.bfloat16:  # fp32-accurate up to the output's own rounding (a bf16 d logits: ~1.4x)
            assert rel_rms(r, g) <= 1.2 * rel_rms(r, r.to(dtype)), name


@pytest.mark.parametrize("used", ["weights", "logits"])
def test_triton_bf16_gradients_of_one_output(used):
    """Only the combine weights (no load-balancing loss: d logits is None) or only the logits (d weight
    is None) reach the loss: the same fp32-accurate bf16 gradients as the fp64 router's."""
    N, D, E, top_k = 24, 16, 16, 4
    h, w = _router_inputs(N, D, E, torch.bfloat16, seed=1)
    dtw = torch.randn(N, top_k, device=DEV)

    def loss(route_fn, hh, ww, cd):
        logits, tw, _ = route_fn(hh, ww, top_k, True, dtype=cd)
        return (tw * dtw.to(cd)).sum() if used == "weights" else load_balancing_loss(logits, top_k, E)

    ref_args = [t.double().requires_grad_() for t in (h, w)]
    ref = torch.autograd.grad(loss(route_ref, *ref_args, torch.float64), ref_args)
    args = [t.clone().requires_grad_() for t in (h, w)]
    got = torch.autograd.grad(loss(route_triton, *args, torch.float32), args)
    for name, r, g in zip(("dhidden", "dgate_weight"), ref, got):
        assert g.dtype == torch.bfloat16
        assert rel_rms(r, g) <= 1.2 * rel_rms(r, r.bfloat16()), name


def test_triton_bwd_split_is_hi_plus_lo_of_fp32_dlogits():
    """The backward kernel's bf16 split [hi | lo] of d logits: hi + lo equals the kernel's own fp32 d
    logits to 2^-14 relative (2^-16 on a device, where hi is torch's bf16 rounding of them and lo that
    of the remainder; the interpreter's casts truncate)."""
    N, E, top_k = 21, 24, 3
    logits = torch.randn(N, E, device=DEV) * 3
    weight, idx = router_topk_fwd(logits, top_k, True)
    dweight, dlogits = torch.randn(N, top_k, device=DEV), torch.randn(N, E, device=DEV) * 1e-3
    dz = router_topk_bwd(logits, idx, dweight, dlogits, True)
    hilo = router_topk_bwd(logits, idx, dweight, dlogits, True, split=True)
    assert hilo.shape == (N, 2 * E) and hilo.dtype == torch.bfloat16
    hi, lo = hilo[:, :E], hilo[:, E:]
    exact = 2.0 ** (-14 if DEV.type == "cpu" else -16)
    assert ((hi.float() + lo.float() - dz).abs() <= dz.abs() * exact).all()
    assert ((hi.float() - dz).abs() <= dz.abs() * 2.0**-7).all()
    if DEV.type != "cpu":
        assert torch.equal(hi, dz.bfloat16()) and torch.equal(lo, (dz - hi.float()).bfloat16())


def test_triton_bf16_hidden_topk_sets_match_fp64():
    """The issue's requirement: bf16 activations routed in fp32 pick the fp64 router's expert set on
    >= 99.9% of tokens (the top-k of the logits of the same bf16 values)."""
    h, w = _router_inputs(128, 64, 64, torch.bfloat16)
    _, _, ti = route_triton(h, w, 8, True)
    _, _, ti64 = route_ref(h, w, 8, True, dtype=torch.float64)
    same = (ti.sort(-1).values == ti64.sort(-1).values).all(-1).float().mean().item()
    assert same >= 0.999, same


def test_triton_empty_deterministic_and_dispatch():
    """N = 0 gives empty outputs and zero gradients; two calls agree bit for bit; non-contiguous hidden
    is taken; dtype fp64 is the torch router's computation; bad inputs raise before launch."""
    h, w = _router_inputs(0, 16, 8)
    wr = w.clone().requires_grad_()
    logits, tw, ti = route_triton(h, wr, 2, True)
    assert logits.shape == (0, 8) and tw.shape == ti.shape == (0, 2)
    (dw,) = torch.autograd.grad(tw.sum() + logits.sum(), [wr])
    assert torch.count_nonzero(dw) == 0
    h, w = _router_inputs(30, 16, 8)
    first, second = route_triton(h, w, 3, True), route_triton(h, w, 3, True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    strided = torch.cat([h, h], 1)[:, ::2]
    assert torch.equal(route_triton(strided, w, 3, True)[2], route_ref(strided, w, 3, True)[2])
    for a, b in zip(route_triton(h, w, 3, True, dtype=torch.float64), route_ref(h, w, 3, True, dtype=torch.float64)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="E <= 512"):
        route_triton(h[:, :4], torch.randn(513, 4, device=DEV), 2, True)
    with pytest.raises(ValueError, match="top_k"):
        route_triton(h, w, 9, True)
    with pytest.raises(ValueError, match="floating"):
        route_triton(h, w, 2, True, dtype=torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("n_tokens", [8192, 16384])
def test_gpu_qwen_router(n_tokens):
    """Qwen3.5-35B shapes (D=2048, 256 experts, top-8), bf16 activations and weights: the kernel's
    ids equal the torch fp32 router's on >= 99.9% of tokens, its sets the fp64 router's on >= 99.9%,
    gradients within the bf16 tolerance of fp64 (<= 1.2x the error of rounding fp64 to bf16 when the
    logits carry a gradient too), bitwise deterministic."""
    h, w = _router_inputs(n_tokens, 2048, 256, torch.bfloat16)
    h, w = h * 0.1, w * 0.05
    _, tw, ti = route_triton(h, w, 8, True)
    _, tw32, ti32 = route_ref(h, w, 8, True)
    _, _, ti64 = route_ref(h, w, 8, True, dtype=torch.float64)
    assert (ti == ti32).all(-1).float().mean().item() >= 0.999
    assert (ti.sort(-1).values == ti64.sort(-1).values).all(-1).float().mean().item() >= 0.999
    agree = (ti == ti32).all(-1)
    assert (tw - tw32)[agree].abs().max().item() <= 1e-5
    dtw = torch.randn_like(tw)
    args = [t.clone().requires_grad_() for t in (h, w)]
    got = torch.autograd.grad((route_triton(*args, 8, True)[1] * dtw).sum(), args)
    ref_args = [t.double().requires_grad_() for t in (h, w)]
    ref = torch.autograd.grad((route_ref(*ref_args, 8, True, dtype=torch.float64)[1] * dtw.double()).sum(), ref_args)
    for name, r, g in zip(("dhidden", "dgate_weight"), ref, got):
        assert_rel_rms(name, r, g, 1e-2)
    again = torch.autograd.grad((route_triton(*args, 8, True)[1] * dtw).sum(), args)
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    # with a logits term of unit cotangents (a near-tie flipped against fp64 then barely shows), both
    # gradients are fp32-accurate up to their bf16 rounding: the cuBLAS GEMMs accumulate in fp32
    dl = torch.randn(n_tokens, 256, device=h.device)

    def loss(out, cd):
        return (out[1] * dtw.to(cd)).sum() + (out[0] * dl.to(cd)).sum()

    got = torch.autograd.grad(loss(route_triton(*args, 8, True), torch.float32), args)
    ref = torch.autograd.grad(loss(route_ref(*ref_args, 8, True, dtype=torch.float64), torch.float64), ref_args)
    for name, r, g in zip(("dhidden", "dgate_weight"), ref, got):
        assert rel_rms(r, g) <= 1.2 * rel_rms(r, r.to(g.dtype)), name


def test_bench_tiny_case_runs_and_checks():
    """`verl-moe bench router` on its CPU case: transformers' router (fp32 here) equals ours in fp32."""
    from verl_moe.tools.bench import BenchConfig, run

    report = run(
        BenchConfig(
            op="router", cases=("tiny-T64-D64-E16-top4",), providers=("torch", "transformers"), warmup=1, reps=1
        )
    )
    assert len(report["rows"]) == 4
    assert all(r["check_ok"] and max(r["rel_rms_per_output"]) < 1e-6 for r in report["rows"])
