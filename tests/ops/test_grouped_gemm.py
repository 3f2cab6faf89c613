"""Triton grouped GEMM (`ops/experts/grouped_gemm.py`) vs an fp64 per-expert loop, for y, dx and
dweight. On CPU the kernels run in the Triton interpreter at small shapes; the `gpu` test repeats the
comparison at Qwen3.5-35B-A3B shapes (256 experts, D=2048, I=512, 8192 tokens top-8) and against
torch's F.grouped_mm.

Tolerances (relative RMS error vs the fp64 loop on the same inputs):

    dtype   y      dx     dweight
    fp32    1e-5   1e-5   1e-5
    bf16    1e-2   1e-2   1e-2
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from verl_moe.ops import device

if not device.is_accelerator():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from verl_moe.ops.common import launch as common_launch  # noqa: E402
from verl_moe.ops.compare import assert_rel_rms  # noqa: E402
from verl_moe.ops.experts.grouped_gemm import grouped_gemm  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def loop_ref(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """y[s] = x[s] @ weight[e].T, one matmul per expert segment (fp64 in the tests)."""
    segments, start = [], 0
    for e, n in enumerate(counts):
        segments.append(x[start : start + n] @ weight[e].T)
        start += n
    return torch.cat(segments, 0)


def make(counts, IN, OUT, dtype, dev="cpu"):
    E, S = len(counts), sum(counts)
    x = torch.randn(S, IN, device=dev).to(dtype)
    w = (torch.randn(E, OUT, IN, device=dev) * IN**-0.5).to(dtype)
    dy = torch.randn(S, OUT, device=dev).to(dtype)
    offsets = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    return x, w, dy, offsets


def run_ours(x, w, dy, offsets):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = grouped_gemm(x, w, offsets)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    return y, dx, dw


def check_vs_fp64(x, w, dy, offsets, counts, tol):
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = loop_ref(x64, w64, counts)
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
    y, dx, dw = run_ours(x, w, dy, offsets)
    assert y.dtype == dx.dtype == dw.dtype == x.dtype
    for name, ref, out in (("y", y64, y), ("dx", dx64, dx), ("dweight", dw64, dw)):
        assert_rel_rms(name, ref, out, tol)


# counts per expert: empty experts between full ones; one expert holding every row (several row tiles
# and a tail); more experts than rows (the grid's row-tile bound is S there).
COUNTS = {
    "mixed": [3, 0, 70, 1, 0, 6],
    "one-expert": [0, 0, 150, 0],
    "sparse": [1, 0, 1, 1, 0, 0, 1, 0],
}


@pytest.mark.parametrize("counts", list(COUNTS.values()), ids=list(COUNTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_fp64_loop(counts, dtype, nan_poison):
    """IN=72, OUT=40: neither a multiple of the tiles, so K tails and column tails are masked."""
    x, w, dy, offsets = make(counts, 72, 40, dtype)
    check_vs_fp64(x, w, dy, offsets, counts, TOL[dtype])


def test_gate_up_and_down_shapes_int64_offsets(nan_poison):
    """Both projections of one expert MLP (OUT = 2I then OUT = D), with int64 offsets."""
    counts, D, I = [5, 0, 20, 9], 24, 16
    for IN, OUT in ((D, 2 * I), (I, D)):
        x, w, dy, offsets = make(counts, IN, OUT, torch.float32)
        check_vs_fp64(x, w, dy, offsets.long(), counts, TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_small_rows_config_matches_fp64_loop(dtype, nan_poison):
    """The pinned config the expert MLP's forward takes at decode sizes (`SMALL_ROWS_CONFIGS`), a few rows
    per expert and some experts empty, OUT below its column tile: y against the fp64 loop."""
    from verl_moe.ops.experts.grouped_gemm import SMALL_ROWS_CONFIGS, grouped_gemm_rows

    counts = [2, 0, 5, 1, 0, 3, 1, 4]
    x, w, _, offsets = make(counts, 72, 40, dtype)
    y = grouped_gemm_rows(x, w.transpose(1, 2), offsets, SMALL_ROWS_CONFIGS)
    assert_rel_rms("y", loop_ref(x.double(), w.double(), counts), y, TOL[dtype])


def test_grid_stride_loops(monkeypatch, nan_poison):
    """With the grid capped at 3 programs every program loops over many work items, in both kernels."""
    monkeypatch.setattr(common_launch, "GRID_LIMIT", 3)
    counts = [40, 0, 90, 7]
    x, w, dy, offsets = make(counts, 72, 136, torch.float32)
    check_vs_fp64(x, w, dy, offsets, counts, TOL[torch.float32])


def test_non_contiguous_inputs(nan_poison):
    """Column-major x and a weight stored as [E, IN, OUT] are read through their strides."""
    counts = [6, 0, 11]
    x, w, dy, offsets = make(counts, 40, 24, torch.float32)
    x_cm = x.T.contiguous().T
    w_t = w.transpose(1, 2).contiguous().transpose(1, 2)
    assert not x_cm.is_contiguous() and not w_t.is_contiguous()
    check_vs_fp64(x_cm, w_t, dy.T.contiguous().T, offsets, counts, TOL[torch.float32])


def test_offsets_past_the_rows_are_clamped(nan_poison):
    """offsets ending past S (not checkable without a host sync) act as if clamped to S."""
    counts = [3, 7, 0]
    x, w, dy, _ = make(counts, 16, 8, torch.float32)
    check_vs_fp64(x, w, dy, torch.tensor([3, 12, 100], dtype=torch.int32), counts, TOL[torch.float32])


def test_no_rows_gives_zero_weight_gradient():
    x, w, dy, offsets = make([0, 0, 0], 16, 8, torch.float32)
    y, dx, dw = run_ours(x, w, dy, offsets)
    assert y.shape == (0, 8) and dx.shape == (0, 16)
    assert dw.shape == w.shape and torch.equal(dw, torch.zeros_like(w))


def test_bitwise_deterministic():
    counts = [30, 0, 50, 4]
    x, w, dy, offsets = make(counts, 72, 40, torch.bfloat16)
    first, second = run_ours(x, w, dy, offsets), run_ours(x, w, dy, offsets)
    for name, a, b in zip(("y", "dx", "dweight"), first, second):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    "args,match",
    [
        (lambda x, w, o: (x.double(), w.double(), o), "share one of"),
        (lambda x, w, o: (x, w.to(torch.bfloat16), o), "share one of"),
        (lambda x, w, o: (x[:, :8], w, o), "columns"),
        (lambda x, w, o: (x, w, o[:2]), "offsets"),
        (lambda x, w, o: (x, w, o.float()), "offsets"),
        (lambda x, w, o: (x, w[0], o), "weight"),
    ],
    ids=["fp64", "mixed-dtype", "width", "offsets-len", "offsets-dtype", "weight-2d"],
)
def test_bad_inputs_raise(args, match):
    x, w, _, offsets = make([2, 3, 1], 16, 8, torch.float32)
    with pytest.raises(ValueError, match=match):
        grouped_gemm(*args(x, w, offsets))


@pytest.mark.gpu
@pytest.mark.gpu_memory
@pytest.mark.parametrize("proj", ["gate_up", "down"])
def test_qwen35_shapes_vs_grouped_mm(proj):
    """256 experts, D=2048, I=512, 8192 tokens routed top-8 (65,536 rows), bf16: ours vs the fp64 loop
    and vs F.grouped_mm, plus bitwise determinism at this size."""
    E, D, I, T, TOPK = 256, 2048, 512, 8192, 8
    IN, OUT = (D, 2 * I) if proj == "gate_up" else (I, D)
    dev = device.current_device()
    idx = torch.rand(T, E, device=dev).topk(TOPK, dim=1).indices
    counts = torch.bincount(idx.reshape(-1), minlength=E).tolist()
    x, w, dy, offsets = make(counts, IN, OUT, torch.bfloat16, dev)
    check_vs_fp64(x, w, dy, offsets, counts, TOL[torch.bfloat16])
    ours = run_ours(x, w, dy, offsets)
    assert all(torch.equal(a, b) for a, b in zip(ours, run_ours(x, w, dy, offsets)))
    if not hasattr(F, "grouped_mm"):
        pytest.skip("this torch has no F.grouped_mm to compare with")
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    yg = F.grouped_mm(xg, wg.transpose(1, 2), offs=offsets)
    dxg, dwg = torch.autograd.grad(yg, (xg, wg), dy)
    for name, ref, out in zip(("y", "dx", "dweight"), (yg, dxg, dwg), ours):
        assert_rel_rms(f"{name} vs grouped_mm", ref, out, TOL[torch.bfloat16])


# Compiles the kernels for sm_90 in a fresh process without TRITON_INTERPRET (set for the tests
# above) and prints, per (kernel, orientation, config), sm_90 registers, spill bytes and shared KiB.
# Pointers and the strides / sizes other than S and E are marked 16-divisible, unit strides are the
# constant 1, as the JIT specialises them for contiguous bf16 tensors at Qwen3.5 shapes.
_COMPILE = """
import json, re, subprocess, sys, tempfile
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from verl_moe.ops.experts import grouped_gemm as gg
from verl_moe.ops.gdn.static_compile import CUOBJDUMP, _jit_fn

first_only = sys.argv[1] == "first"
rows = _jit_fn(gg._grouped_gemm_rows_kernel)
dw = _jit_fn(gg._grouped_gemm_dw_kernel)
fwd = {**gg._rows_meta({"K": 2048, "E": 256}), "stride_ak": 1, "stride_cn": 1}
builds = [(rows, gg.ROWS_CONFIGS, {**fwd, "stride_bk": 1}), (rows, gg.ROWS_CONFIGS, {**fwd, "stride_bn": 1})]
builds.append((dw, gg.DW_CONFIGS, {"stride_dyo": 1, "stride_xi": 1}))
out = []
for dt, prec, ptr in [(tl.bfloat16, "tf32", "*bf16")] + [(tl.float32, "ieee", "*fp32")] * first_only:
    for fn, configs, fixed in builds:
        for cfg in configs[:1] if first_only else configs:
            cfg = dict(cfg)
            warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
            ce = {**cfg, **fixed, "DT": dt, "DOT_PREC": prec}
            ints = [n for n in fn.arg_names if n.isupper() or n.startswith("stride")]
            sig = {n: "constexpr" if n in ce else "*i32" if n == "offsets" else "i32" if n in ints else ptr
                   for n in fn.arg_names}
            attrs = {(i,): [["tt.divisibility", 16]]
                     for i, n in enumerate(fn.arg_names) if sig[n] != "constexpr" and n not in ("S", "E")}
            src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=ce, attrs=attrs)
            options = {"num_warps": warps, "num_stages": stages}
            k = triton.compile(src, target=GPUTarget("cuda", 90, 128), options=options)
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(k.asm["cubin"])
                f.flush()
                res = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True)
            regs = int(re.search(r"REG:(\\d+)", res.stdout).group(1))
            spill = int(re.search(r"STACK:(\\d+)", res.stdout).group(1))
            smem = k.metadata.shared // 1024
            out.append([fn.__name__, str(dt), sorted(fixed), cfg, warps, stages, regs, spill, smem])
print(json.dumps(out))
"""


def _compile_report(which: str) -> list:
    import json
    import subprocess
    import sys

    from verl_moe.ops.gdn.static_compile import CUOBJDUMP

    if not os.path.exists(CUOBJDUMP):
        pytest.skip("needs Triton's NVIDIA backend (ptxas, cuobjdump) to compile for sm_90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, which], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _assert_fits(rows: list) -> None:
    assert rows
    bad = [r for r in rows if r[7] > 0 or not 0 < r[6] <= 255 or r[8] > 227]
    assert not bad, (
        f"spills or over sm_90 limits (kernel, dtype, units, config, warps, stages, regs, spill, KiB): {bad}"
    )


def test_first_configs_compile_for_sm90_without_spills():
    """The first configs (what fp32 inputs and deterministic mode run alone), bf16 and fp32 builds."""
    _assert_fits(_compile_report("first"))


@pytest.mark.slow
def test_all_configs_compile_for_sm90_without_spills():
    _assert_fits(_compile_report("all"))
