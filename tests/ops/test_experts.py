"""MoE experts over fused weights vs a dense fp64 formula and vs transformers' Qwen3MoeExperts, on
every implementation (the loop reference, the grouped GEMMs with torch token moves, the grouped GEMMs
with the Triton token moves: interpreter on CPU).

Tolerances (rel RMS):
| quantity                               | tol  |
| fp32 out vs fp64 dense formula         | 1e-6 |
| fp32 grads vs fp64                     | 1e-5 |
| bf16 out and grads vs fp64             | 1e-2 |
| fp32 vs transformers (same weights)    | 1e-6 |
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
from verl_moe.ops import device
from verl_moe.ops.compare import assert_rel_rms
from verl_moe.ops.dispatch import resolve
from verl_moe.ops.experts.permute import gather_sum, moe_sort, scatter_rows
from verl_moe.ops.experts.reference import moe_experts_ref, sort_ref

N, D, E, I, TOPK = 24, 16, 6, 8, 2
IMPLS = ["torch", "grouped", "triton"]
GRAD_NAMES = ("dhidden", "dgate_up", "ddown", "dweight")
DEV = device.current_device()

# Every op test runs on each implementation.
by_impl = pytest.mark.parametrize("impl", IMPLS)


@pytest.fixture
def moe_experts(impl):
    return resolve("experts", impl)


def dense_formula(h, gate_up, down, idx, w):
    """Every expert on every token, combined with a dense [N, E] weight matrix (fp64)."""
    h, gate_up, down = h.double(), gate_up.double(), down.double()
    I = gate_up.shape[1] // 2
    combine = torch.zeros(h.shape[0], gate_up.shape[0], dtype=torch.float64, device=h.device)
    combine.scatter_(1, idx, w.double())
    gate = torch.einsum("nd,eid->nei", h, gate_up[:, :I])
    up = torch.einsum("nd,eid->nei", h, gate_up[:, I:])
    y = torch.einsum("nei,edi->ned", F.silu(gate) * up, down)
    return (combine[..., None] * y).sum(1)


def inputs(dtype=torch.float32, n=N, d=D, e=E, i=I, top_k=TOPK):
    h = torch.randn(n, d, dtype=dtype)
    gate_up = (torch.randn(e, 2 * i, d) * 0.3).to(dtype)
    down = (torch.randn(e, d, i) * 0.3).to(dtype)
    idx = torch.stack([torch.randperm(e)[:top_k] for _ in range(n)]) if n else torch.zeros(0, top_k, dtype=torch.long)
    w = torch.softmax(torch.randn(n, top_k), -1)
    return tuple(t.to(DEV) for t in (h, gate_up, down, idx, w))


def check_grads(moe_experts, h, gu, dn, idx, w, tol):
    """Output and the gradients of hidden, both weights and the combine weights against the dense fp64
    formula on the same (rounded) inputs."""
    dy = torch.randn(h.shape[0], h.shape[1], device=h.device)
    a64 = [t.double().requires_grad_() for t in (h, gu, dn, w)]
    ref_out = dense_formula(a64[0], a64[1], a64[2], idx, a64[3])
    ref = torch.autograd.grad((ref_out * dy.double()).sum(), a64)
    args = [t.clone().requires_grad_() for t in (h, gu, dn, w)]
    out = moe_experts(args[0], args[1], args[2], idx, args[3])
    got = torch.autograd.grad((out.float() * dy).sum(), args)
    assert out.dtype == h.dtype
    assert_rel_rms("out", ref_out, out, tol)
    for name, r, g in zip(GRAD_NAMES, ref, got):
        assert g.dtype == (w.dtype if name == "dweight" else h.dtype), name
        assert_rel_rms(name, r, g, tol)


@by_impl
def test_fp32_matches_dense_fp64(moe_experts):
    h, gu, dn, idx, w = inputs()
    out = moe_experts(h, gu, dn, idx, w)
    assert_rel_rms("out", dense_formula(h, gu, dn, idx, w), out, 1e-6)


@by_impl
def test_bf16_weights_fp32_combine(moe_experts):
    h, gu, dn, idx, w = inputs(torch.bfloat16)
    out = moe_experts(h, gu, dn, idx, w)
    assert out.dtype == torch.bfloat16
    assert_rel_rms("out", dense_formula(h, gu, dn, idx, w), out, 1e-2)


@by_impl
def test_gradients_match_fp64(moe_experts):
    check_grads(moe_experts, *inputs(), 1e-5)


@by_impl
def test_bf16_gradients_match_fp64(moe_experts):
    check_grads(moe_experts, *inputs(torch.bfloat16), 1e-2)


@by_impl
@pytest.mark.parametrize(
    "shape", [dict(n=1), dict(top_k=1), dict(d=13, i=7), dict(n=12, e=40)], ids=["N1", "TOPK1", "odd", "E40-idle"]
)
def test_shapes_match_fp64(moe_experts, shape):
    """One token, one expert per token, odd widths (the grouped path's segment loop: rows not 16-byte
    aligned), more experts than tokens per expert (many idle)."""
    check_grads(moe_experts, *inputs(**shape), 1e-5)


@by_impl
def test_no_tokens(moe_experts):
    """N = 0 (an expert-parallel rank can receive no token): empty output, zero gradients of
    the same shapes for every input."""
    h, gu, dn, idx, w = inputs(n=0)
    args = [t.clone().requires_grad_() for t in (h, gu, dn, w)]
    out = moe_experts(args[0], args[1], args[2], idx, args[3])
    assert out.shape == (0, D) and out.dtype == h.dtype
    grads = torch.autograd.grad(out.sum(), args)
    for a, g in zip(args, grads):
        assert g.shape == a.shape and torch.count_nonzero(g) == 0


@by_impl
def test_non_contiguous_inputs(moe_experts):
    h, gu, dn, idx, w = inputs()
    strided = [torch.stack([t, t], -1)[..., 0] for t in (h, gu, dn, idx, w)]
    assert not strided[0].is_contiguous()
    assert torch.equal(moe_experts(*strided), moe_experts(h, gu, dn, idx, w))


@by_impl
def test_matches_transformers_layout(moe_experts):
    """Same fused parameters give transformers' output: gate rows first, down_proj [E, D, I]."""
    hf = Qwen3MoeExperts(Qwen3MoeConfig(num_experts=E, hidden_size=D, moe_intermediate_size=I))
    h, gu, dn, idx, w = inputs()
    with torch.no_grad():
        hf.to(DEV)
        hf.gate_up_proj.copy_(gu)
        hf.down_proj.copy_(dn)
        ref = hf(h, idx, w)
    assert_rel_rms("vs transformers", ref, moe_experts(h, gu, dn, idx, w), 1e-6)


@by_impl
def test_bad_inputs_raise(moe_experts):
    h, gu, dn, idx, w = inputs()
    with pytest.raises(ValueError, match="share one dtype"):
        moe_experts(h.double(), gu, dn, idx, w)
    with pytest.raises(ValueError, match=r"in \[0, E=6\)"):
        moe_experts(h, gu, dn, idx.clone().fill_(E), w)
    with pytest.raises(ValueError, match=r"down_proj must be \[E, D, I\]"):
        moe_experts(h, gu, dn.transpose(1, 2), idx, w)
    with pytest.raises(ValueError, match=r"\[N=24, TOPK\]"):
        moe_experts(h, gu, dn, idx[:-1], w[:-1])


@by_impl
def test_idle_experts_and_fp64(moe_experts, impl):
    """Experts that receive no token, and fp64 (the grouped path's segment loop; the Triton moves
    compute in fp32 and refuse it)."""
    idx = torch.stack([torch.tensor([1, 4]) if n % 2 else torch.tensor([4, 1]) for n in range(N)]).to(DEV)
    if impl == "triton":
        h, gu, dn, _, w = inputs()
        check_grads(moe_experts, h, gu, dn, idx, w, 1e-5)
        with pytest.raises(ValueError, match="fp32/bf16/fp16"):
            moe_experts(h.double(), gu.double(), dn.double(), idx, w)
        return
    h, gu, dn, _, w = inputs(torch.float64)
    assert_rel_rms("out", dense_formula(h, gu, dn, idx, w), moe_experts(h, gu, dn, idx, w), 1e-12)


@by_impl
def test_bitwise_deterministic(moe_experts):
    """Two calls: the same output and gradients, bit for bit."""
    h, gu, dn, idx, w = inputs(torch.bfloat16)
    runs = []
    for _ in range(2):
        args = [t.clone().requires_grad_() for t in (h, gu, dn, w)]
        out = moe_experts(args[0], args[1], args[2], idx, args[3])
        runs.append([out, *torch.autograd.grad(out.float().square().sum(), args)])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


# --- the Triton token moves alone ---


@pytest.mark.parametrize("S,E_", [(1, 1), (65, 3), (200, 130)], ids=["S1", "S65-E3", "S200-E130"])
def test_counting_sort_is_the_stable_argsort(nan_poison, S, E_):
    """Slots, inverse, counts and ends equal a stable argsort's, across sort blocks (64 copies) and
    expert chunks (64 experts), with idle experts."""
    ids = torch.randint(0, E_, (S,), device=DEV)
    ids[::7] = E_ - 1  # a crowded expert
    got, ref = moe_sort(ids, E_), sort_ref(ids, E_)
    for name, a, b in zip(ref._fields, got, ref):
        assert a.dtype == torch.int32 and torch.equal(a, b), name


def test_scatter_and_gather_sum_are_adjoint(nan_poison):
    """scatter_rows puts token t's row at its TOPK slots; gather_sum(scatter_rows(x)) = TOPK * x in fp32;
    <scatter(x), y> = <x, gather_sum(y)> (each is the other's backward)."""
    n, d, top_k, e = 37, 40, 3, 9
    ids = torch.stack([torch.randperm(e)[:top_k] for _ in range(n)]).to(DEV).reshape(-1)
    routing = moe_sort(ids, e)
    x, y = torch.randn(n, d, device=DEV), torch.randn(n * top_k, d, device=DEV)
    xs = scatter_rows(x, routing.dest, top_k)
    assert torch.equal(xs, x[routing.src.long() // top_k])
    assert torch.equal(gather_sum(xs, routing.dest, top_k), x * top_k)
    lhs, rhs = (xs.double() * y.double()).sum(), (x.double() * gather_sum(y, routing.dest, top_k).double()).sum()
    assert abs(lhs - rhs) <= 1e-5 * abs(lhs)


@pytest.mark.gpu
@pytest.mark.gpu_memory
@pytest.mark.parametrize("n_tokens", [256, 4096, 16384])
def test_gpu_qwen_experts(n_tokens):
    """Qwen3.5-35B experts (256 x (2048 -> 512), top-8), bf16: the Triton path's output and every
    gradient against the loop reference in fp64, the sort against the argsort, bitwise determinism.
    256 tokens (8 rows per expert) takes the forward's small-rows Triton GEMM, the others F.grouped_mm."""
    E_, D_, I_, K_ = 256, 2048, 512, 8
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n_tokens, D_, generator=g).to(DEV, torch.bfloat16)
    gu = (torch.randn(E_, 2 * I_, D_, generator=g) * 0.02).to(DEV, torch.bfloat16)
    dn = (torch.randn(E_, D_, I_, generator=g) * 0.02).to(DEV, torch.bfloat16)
    idx = torch.randn(n_tokens, E_, generator=g).topk(K_, -1).indices.to(DEV)
    w = torch.softmax(torch.randn(n_tokens, K_, generator=g), -1).to(DEV)
    ref_routing = sort_ref(idx.reshape(-1), E_)
    for name, a, b in zip(ref_routing._fields, moe_sort(idx.reshape(-1), E_), ref_routing):
        assert torch.equal(a, b), name
    dy = torch.randn(n_tokens, D_, device=DEV, dtype=torch.bfloat16)
    a64 = [t.double().requires_grad_() for t in (h, gu, dn, w)]
    ref_out = moe_experts_ref(a64[0], a64[1], a64[2], idx, a64[3])
    ref = torch.autograd.grad((ref_out * dy.double()).sum(), a64)
    experts = resolve("experts", "triton")
    runs = []
    for _ in range(2):
        args = [t.clone().requires_grad_() for t in (h, gu, dn, w)]
        out = experts(args[0], args[1], args[2], idx, args[3])
        runs.append([out, *torch.autograd.grad((out * dy).sum(), args)])
    for name, r, got in zip(("out", *GRAD_NAMES), [ref_out, *ref], runs[0]):
        assert_rel_rms(name, r, got, 1e-2)
    assert all(torch.equal(a, b) for a, b in zip(*runs)), "not bitwise deterministic"


def test_bench_tiny_case_runs_and_checks():
    """`verl-moe bench experts` on its CPU case: every torch-side provider passes the check against the
    loop reference (transformers' grouped_mm module gets the bench's leaves as its weights)."""
    from verl_moe.tools.bench import BenchConfig, run

    report = run(
        BenchConfig(op="experts", cases=("tiny-T64-E8-top2-D64-I32",), providers=("torch", "grouped", "transformers"),
                    warmup=1, reps=1)
    )  # fmt: skip
    assert {r["provider"] for r in report["rows"]} == {"torch", "grouped", "transformers"}
    assert all(r["check_ok"] and len(r["rel_rms_per_output"]) in (1, 5) for r in report["rows"])


def test_triton_saves_only_the_gate_up_output():
    """The Triton path keeps, of the [S, *] activations (S = N * TOPK copies), only the gate_up output
    [S, 2I] for backward: the permuted rows [S, D] and the activation [S, I] are recomputed."""
    h, gu, dn, idx, w = inputs()
    args = [t.clone().requires_grad_() for t in (h, gu, dn, w)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        resolve("experts", "triton")(args[0], args[1], args[2], idx, args[3])
    S = N * TOPK
    assert [s for s in saved if len(s) == 2 and s[0] == S] == [(S, 2 * I)], saved


def test_grouped_linear_takes_the_triton_grouped_gemm_without_grouped_mm(monkeypatch):
    """Where F.grouped_mm cannot run (NPU, unaligned rows on cuda), grouped_linear runs our Triton grouped
    GEMM instead of a per-expert loop; it equals the fp64 loop."""
    from verl_moe.ops.experts import grouped, grouped_gemm

    calls = []
    real = grouped_gemm.grouped_gemm
    monkeypatch.setattr(grouped_gemm, "grouped_gemm", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(grouped, "_grouped_mm_ok", lambda x, w: False)
    x, w = torch.randn(20, 16), torch.randn(3, 8, 16)
    offsets = torch.tensor([5, 5, 20], dtype=torch.int32)
    y = grouped.grouped_linear(x, w, offsets)
    ref = grouped.grouped_linear(x.double(), w.double(), offsets)  # fp64 takes the segment loop
    assert calls == [1]
    assert_rel_rms("y", ref, y, 1e-6)
