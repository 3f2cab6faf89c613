"""RMSNorm: the references vs an fp64 formula and transformers' Qwen3.5 / Qwen3-MoE norm modules, and
the Triton kernels (`ops/norm/fused.py`, in the interpreter on CPU) vs the reference run in fp64.

Tolerances (rel RMS vs fp64; outputs and every gradient: x, weight, gate, residual):
| dtype | reference vs formula | triton vs fp64 reference |
| fp32  | 1e-6                 | 1e-5                     |
| bf16  | 1e-2                 | 1e-2                     |
transformers' modules: bit-identical to the reference in fp32 and bf16 (same rounding points). The
kernel's bf16 forward keeps the reference's rounding points: at most 1% of its outputs differ from
the reference's bits (where an fp32 ulp of x_hat tips a rounding).
"""

import os

import pytest
import torch
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm, Qwen3_5MoeRMSNormGated
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm
from verl_moe.ops import device

if not device.is_accelerator():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from verl_moe.ops import resolve  # noqa: E402
from verl_moe.ops.compare import assert_rel_rms, rel_rms  # noqa: E402
from verl_moe.ops.norm import IMPLS, fused, gated_rms_norm, rms_norm, rms_norm_ref  # noqa: E402

TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}
EPS = 1e-6


def formula(x, w, gate=None, unit_offset=False):
    """Textbook RMSNorm in fp64."""
    x, w = x.double(), w.double()
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * ((1 + w) if unit_offset else w)
    return y if gate is None else y * gate.double() * torch.sigmoid(gate.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["plain", "unit_offset", "gated"])
def test_matches_fp64_formula(dtype, variant):
    x = torch.randn(3, 5, 48) * 3
    w = torch.randn(48) * 0.2 + (0.0 if variant == "unit_offset" else 1.0)
    gate = torch.randn(3, 5, 48)
    if variant == "gated":
        out = gated_rms_norm(x.to(dtype), gate.to(dtype), w.to(dtype), EPS)
        ref = formula(x.to(dtype), w.to(dtype), gate.to(dtype))
    else:
        out = rms_norm(x.to(dtype), w.to(dtype), EPS, unit_offset=variant == "unit_offset")
        ref = formula(x.to(dtype), w.to(dtype), unit_offset=variant == "unit_offset")
    assert out.dtype == dtype
    assert_rel_rms(f"rms_norm[{variant}]", ref, out, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bit_equal_to_transformers(dtype):
    x, gate = torch.randn(4, 7, 32, dtype=dtype), torch.randn(4, 7, 32, dtype=dtype)
    q35, q3, gated = Qwen3_5MoeRMSNorm(32, EPS), Qwen3MoeRMSNorm(32, EPS), Qwen3_5MoeRMSNormGated(32, EPS)
    with torch.no_grad():
        for m in (q35, q3, gated):
            m.to(dtype).weight.copy_(torch.randn(32) * 0.3 + 1)
        assert torch.equal(rms_norm(x, q35.weight, EPS, unit_offset=True), q35(x))
        assert torch.equal(rms_norm(x, q3.weight, EPS), q3(x))
        assert torch.equal(gated_rms_norm(x, gate, gated.weight, EPS), gated(x, gate))


def test_gradients_match_fp64():
    x = torch.randn(6, 40, dtype=torch.float64, requires_grad=True)
    w = (torch.randn(40, dtype=torch.float64) * 0.1).requires_grad_()
    g = torch.randn(6, 40, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(6, 40, dtype=torch.float64)
    for gated in (False, True):
        args = (x, w, g) if gated else (x, w)
        ref = torch.autograd.grad((formula(x, w, g if gated else None, unit_offset=not gated) * dy).sum(), args)
        x32 = [a.detach().float().requires_grad_() for a in args]
        out = gated_rms_norm(x32[0], x32[2], x32[1], EPS) if gated else rms_norm(*x32, EPS, unit_offset=True)
        grads = torch.autograd.grad((out * dy.float()).sum(), x32)
        for name, r, o in zip(("dx", "dw", "dgate"), ref, grads):
            assert_rel_rms(f"{name} gated={gated}", r, o, 1e-5)


def test_dispatch_default_is_reference_on_cpu():
    fn = resolve("norm")
    x, w = torch.randn(2, 8), torch.randn(8)
    assert torch.equal(fn(x, w, EPS, unit_offset=True), rms_norm(x, w, EPS, unit_offset=True))


def test_bad_inputs_raise():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, torch.ones(7))
    with pytest.raises(ValueError, match="gate must have"):
        gated_rms_norm(x, torch.randn(2, 7), torch.ones(8))
    with pytest.raises(ValueError, match="floating point"):
        rms_norm(torch.ones(2, 8, dtype=torch.long), torch.ones(8))
    with pytest.raises(ValueError, match="unit_offset"):
        resolve("norm")(x, torch.ones(8), EPS, unit_offset=True, gate=x)


def test_reference_residual_is_the_models_add_then_norm():
    x, r = torch.randn(3, 5, 24, dtype=torch.bfloat16), torch.randn(3, 5, 24, dtype=torch.bfloat16)
    w = torch.randn(24) * 0.1
    for unit_offset in (False, True):
        out, h = rms_norm_ref(x, w.bfloat16(), EPS, unit_offset, residual=r)
        assert torch.equal(h, x + r)  # added in bf16, as `hidden = hidden + x`
        assert torch.equal(out, rms_norm_ref(x + r, w.bfloat16(), EPS, unit_offset))
        assert_rel_rms("residual norm", formula(x + r, w.bfloat16(), unit_offset=unit_offset), out, TOL[torch.bfloat16])
    xd, rd = (t.double().requires_grad_() for t in (x, r))
    out, h = rms_norm_ref(xd, w.double(), EPS, residual=rd)
    dx, dr = torch.autograd.grad((out * torch.randn_like(out)).sum() + (h * torch.randn_like(h)).sum(), [xd, rd])
    assert torch.equal(dx, dr)
    with pytest.raises(ValueError, match="residual must have"):
        rms_norm_ref(x, w, EPS, residual=r.float())


# ---- Triton kernels vs the fp64 reference ---------------------------------------------------------

KERNEL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _make(shape, dtype, variant, residual, device=None, mean=0.0):
    """Leaf inputs in `dtype` and cotangents for norm(h) (and h) of [*shape] rows."""
    D = shape[-1]
    x = torch.randn(*shape, device=device) * 3 + mean
    w = torch.randn(D, device=device) * 0.2 + (0.0 if variant == "unit_offset" else 1.0)
    gate = torch.randn(*shape, device=device) if variant == "gated" else None
    res = torch.randn(*shape, device=device) if residual else None
    leaves = {n: t.to(dtype) for n, t in {"x": x, "weight": w, "gate": gate, "residual": res}.items() if t is not None}
    cot = [torch.randn(*shape, device=device).to(dtype) for _ in range(2 if residual else 1)]
    return leaves, cot


def _forward_backward(fn, leaves, cot, unit_offset, cast=None):
    """fn's outputs (norm, and h with a residual) and the gradients of every leaf, the inputs cast by `cast`."""
    inputs = {n: (t if cast is None else t.to(cast)).detach().requires_grad_() for n, t in leaves.items()}
    out = fn(inputs["x"], inputs["weight"], EPS, unit_offset, gate=inputs.get("gate"), residual=inputs.get("residual"))
    outs = list(out) if isinstance(out, tuple) else [out]
    grads = torch.autograd.grad(outs, list(inputs.values()), [c if cast is None else c.to(cast) for c in cot])
    return [o.detach() for o in outs], dict(zip(inputs, grads))


def _assert_close(name, ref, out, tol):
    if ref.numel() == 0:  # no rows: nothing to compare but the shape
        assert out.shape == ref.shape, name
    else:
        assert_rel_rms(name, ref, out, tol)


def _check_against_fp64(leaves, cot, unit_offset, tol, fn=fused.rms_norm):
    outs, grads = _forward_backward(fn, leaves, cot, unit_offset)
    ref_outs, ref_grads = _forward_backward(rms_norm_ref, leaves, cot, unit_offset, cast=torch.float64)
    for name, r, o in zip(("y", "h"), ref_outs, outs):
        assert o.dtype == leaves["x"].dtype
        _assert_close(name, r, o, tol)
    for name in leaves:
        assert grads[name].dtype == leaves[name].dtype
        _assert_close(f"d{name}", ref_grads[name], grads[name], tol)
    return outs, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "residual"])
@pytest.mark.parametrize(
    "variant,shape", [("plain", (70, 130)), ("unit_offset", (3, 5, 72)), ("gated", (2, 9, 72))], ids=str
)
def test_triton_matches_fp64_reference(dtype, residual, variant, shape, nan_poison):
    leaves, cot = _make(shape, dtype, variant, residual)
    outs, grads = _check_against_fp64(leaves, cot, variant == "unit_offset", KERNEL_TOL[dtype])
    if residual:
        assert torch.equal(outs[1], leaves["x"] + leaves["residual"])  # h in x.dtype, as the model's add
        assert torch.equal(grads["x"], grads["residual"])
    if dtype == torch.bfloat16:  # the reference's rounding points, not just its tolerance
        ref = rms_norm_ref(**{k: v for k, v in leaves.items()}, eps=EPS, unit_offset=variant == "unit_offset")
        ref = ref[0] if residual else ref
        assert (outs[0] != ref).float().mean().item() <= 1e-2


@pytest.mark.parametrize("rows", [1, 0])
def test_triton_one_and_zero_rows(rows, nan_poison):
    for variant, residual in (("unit_offset", True), ("gated", False)):
        leaves, cot = _make((rows, 40), torch.float32, variant, residual)
        outs, grads = _check_against_fp64(leaves, cot, variant == "unit_offset", KERNEL_TOL[torch.float32])
        assert outs[0].shape == (rows, 40)
        if rows == 0:
            assert torch.equal(grads["weight"], torch.zeros(40))


def test_triton_wide_rows_loop_over_blocks(monkeypatch, nan_poison):
    """Rows wider than MAX_BD take the looped path (two reads per row, the per-row dot kernel)."""
    monkeypatch.setattr(fused, "MAX_BD", 32)  # D = 130: four whole 32-blocks and a masked tail
    assert fused._meta({"D": 130})["BD"] == 32
    for variant, residual in (("unit_offset", False), ("gated", True), ("plain", True)):
        leaves, cot = _make((37, 130), torch.float32, variant, residual)
        _check_against_fp64(leaves, cot, variant == "unit_offset", KERNEL_TOL[torch.float32])


@pytest.mark.parametrize("rows,D,cores", [(150, 130, 4), (100, 40, 8)], ids=["blocks_per_program", "idle_programs"])
def test_triton_backward_programs_walk_row_blocks(rows, D, cores, monkeypatch, nan_poison):
    """The backward's persistent programs: 5 programs over 10 blocks of 16 rows (two blocks each, the
    last block 6 rows), and 4 programs over 2 blocks of 64 rows (two programs own no block and must
    write zero d weight partials into the NaN-filled buffer)."""
    monkeypatch.setattr(fused, "_cores", lambda: cores)
    assert fused._bwd_programs(rows, cores) == {150: 5, 100: 4}[rows]
    for variant, residual in (("unit_offset", True), ("gated", False)):
        leaves, cot = _make((rows, D), torch.float32, variant, residual)
        _check_against_fp64(leaves, cot, variant == "unit_offset", KERNEL_TOL[torch.float32])


def test_triton_strided_rows_without_copy(nan_poison):
    """q/k norms get [B, T, H, K] views of a projection: rows with one stride are read in place (and
    their gradient reaches the projection); views whose rows do not flatten are copied."""
    B, T, H, K = 2, 3, 4, 24
    proj = torch.randn(B, T, H * 2 * K)
    q = proj.view(B, T, H, 2 * K)[..., :K]
    assert fused._as_rows(q, K).data_ptr() == q.data_ptr()
    transposed = torch.randn(B, H, T, K).transpose(1, 2)  # [B, T, H, K], rows not one stride apart
    assert fused._as_rows(transposed, K).is_contiguous()
    w, dy = torch.randn(K) * 0.1, torch.randn(B, T, H, K)
    for x in (q, transposed):
        _check_against_fp64({"x": x, "weight": w}, [dy], True, KERNEL_TOL[torch.float32])

    def d_proj(fn, p):
        p = p.detach().requires_grad_()
        return torch.autograd.grad(fn(p.view(B, T, H, 2 * K)[..., :K], w.to(p.dtype), EPS, True), p, dy.to(p.dtype))[0]

    grad = d_proj(fused.rms_norm, proj)
    assert_rel_rms("d proj", d_proj(rms_norm_ref, proj.double()), grad, KERNEL_TOL[torch.float32])
    assert grad.view(B, T, H, 2 * K)[..., K:].abs().max() == 0  # the other half of the projection


def test_triton_bitwise_deterministic(nan_poison):
    leaves, cot = _make((150, 72), torch.bfloat16, "gated", True)  # several backward programs
    assert fused._bwd_programs(150, fused._cores()) > 1
    first = _forward_backward(fused.rms_norm, leaves, cot, False)
    second = _forward_backward(fused.rms_norm, leaves, cot, False)
    for a, b in zip(first[0] + list(first[1].values()), second[0] + list(second[1].values())):
        assert torch.equal(a, b)


def test_triton_statistics_in_fp32(nan_poison):
    """bf16 rows with a large mean: the kernel's rstd (the fp32 statistic it saves) matches the fp64
    one to fp32 precision, which a bf16 statistic cannot (its rounding alone is off by ~1e-3)."""
    x = (torch.randn(16, 130) * 0.5 + 60).bfloat16()
    w = torch.randn(130).bfloat16()
    _, _, rstd = fused.rms_norm_fwd(x, w, None, None, EPS, False, x.shape)
    ref = torch.rsqrt(x.double().pow(2).mean(-1) + EPS)
    bf16_statistic = torch.rsqrt(x.pow(2).mean(-1) + EPS)
    assert rel_rms(ref, bf16_statistic) > 1e-4  # what the check below rules out
    assert_rel_rms("rstd", ref, rstd, 1e-6)
    leaves, cot = _make((16, 130), torch.bfloat16, "plain", True, mean=60.0)
    _check_against_fp64(leaves, cot, False, KERNEL_TOL[torch.bfloat16])


def test_triton_is_registered_and_refuses_bad_inputs():
    assert IMPLS["triton"] == "verl_moe.ops.norm.fused:rms_norm"
    assert resolve("norm", "triton") is fused.rms_norm
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="float64"):
        fused.rms_norm(x.double(), torch.ones(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="residual must have"):
        fused.rms_norm(x, torch.ones(8), residual=x.bfloat16())
    with pytest.raises(ValueError, match="unit_offset"):
        fused.rms_norm(x, torch.ones(8), unit_offset=True, gate=x)
    with pytest.raises(ValueError, match="D = x.shape"):
        fused.rms_norm(torch.randn(2, 0), torch.ones(0))


def test_triton_fp32_weight_with_bf16_rows(nan_poison):
    """An fp32 weight (e.g. unsharded master params) promotes `weight * x_hat.to(bf16)` to fp32 in the
    reference: the kernel rounds where it does."""
    for variant in ("plain", "gated"):
        leaves, cot = _make((24, 72), torch.bfloat16, variant, False)
        leaves["weight"] = leaves["weight"].float() + 1e-3 * torch.randn(72)  # not a bf16 value
        outs, _ = _check_against_fp64(leaves, cot, False, KERNEL_TOL[torch.bfloat16])
        ref = rms_norm_ref(**leaves, eps=EPS)
        assert (outs[0] != ref).float().mean().item() <= 1e-2


def test_bench_runs_its_reference_on_cpu(monkeypatch):
    from verl_moe.tools import bench
    from verl_moe.tools.bench.ops import norm as norm_bench

    tiny = [{**c, "shape": (*[2] * (len(c["shape"]) - 1), c["shape"][-1] // 32)} for c in norm_bench.CASES]
    monkeypatch.setattr(norm_bench, "CASES", tiny)
    report = bench.run(bench.BenchConfig(op="norm", providers=("torch",), warmup=1, reps=1))
    assert len(report["rows"]) == 2 * len(tiny) and all(r["check_ok"] for r in report["rows"])
    inputs = norm_bench.make_inputs(next(c for c in tiny if c.get("residual")), torch.device("cpu"))
    assert len(norm_bench.run("torch", inputs, "fwd_bwd")) == 2 + 3  # norm, h, dx, dweight, dresidual


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "variant,residual,shape",
    [
        ("unit_offset", True, (1, 4096, 2048)),  # decoder layer: residual add + post-attention norm
        ("unit_offset", False, (4096, 16, 256)),  # q/k norm rows
        ("gated", False, (4096, 32, 128)),  # GatedDeltaNet output norm
        ("plain", True, (1024, 8192)),  # wider than MAX_BD: the looped path
    ],
    ids=str,
)
def test_gpu_qwen_shapes_match_reference(dtype, variant, residual, shape):
    dev = device.current_device()
    leaves, cot = _make(shape, dtype, variant, residual, device=dev)
    outs, grads = _check_against_fp64(leaves, cot, variant == "unit_offset", KERNEL_TOL[dtype])
    if dtype == torch.bfloat16:  # the reference's rounding points (fp32 outputs differ in ulps of x_hat)
        ref = rms_norm_ref(**leaves, eps=EPS, unit_offset=variant == "unit_offset")
        ref = ref[0] if residual else ref
        assert (outs[0] != ref).float().mean().item() <= 1e-2
    again_outs, again_grads = _forward_backward(fused.rms_norm, leaves, cot, variant == "unit_offset")
    assert all(torch.equal(a, b) for a, b in zip(outs, again_outs))
    assert all(torch.equal(grads[n], again_grads[n]) for n in grads)


@pytest.mark.gpu
def test_gpu_strided_q_view():
    dev = device.current_device()
    proj = torch.randn(1, 4096, 16 * 512, device=dev, dtype=torch.bfloat16)
    q = proj.view(1, 4096, 16, 512)[..., :256]
    leaves, cot = {"x": q, "weight": torch.randn(256, device=dev).bfloat16() * 0.1}, [torch.randn_like(q)]
    _check_against_fp64(leaves, cot, True, KERNEL_TOL[torch.bfloat16])
