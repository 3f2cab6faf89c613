"""Depthwise causal conv1d + SiLU over packed sequences: the reference vs an explicit fp64 loop, and
our Triton kernels (`ops/conv1d/conv.py`, in the interpreter on CPU) vs the reference run in fp64.

Tolerances (rel RMS vs the fp64 loop / the fp64 reference):
| impl   | dtype | out  | dx, dw, dbias |
| torch  | fp32  | 1e-6 | 1e-5          |
| torch  | bf16  | 1e-2 | -             |
| triton | fp32  | 1e-5 | 1e-5          |
| triton | bf16  | 1e-2 | 1e-2          |
"""

import os

import pytest
import torch
import torch.nn.functional as F
from verl_moe.ops import device

if not device.is_accelerator():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from verl_moe.ops.compare import assert_rel_rms  # noqa: E402
from verl_moe.ops.conv1d import causal_conv1d, causal_conv1d_ref  # noqa: E402

DEV = device.current_device()
LENGTHS = [5, 1, 9, 3]  # includes a length-1 sequence and one shorter than the kernel
C, W = 12, 4


def loop_formula(x, weight, bias, lengths):
    """out[t, c] = silu(sum_j weight[c, j] * x[t - W + 1 + j, c] + bias[c]), zero before each sequence start."""
    x, weight = x.double()[0], weight.double()
    out = torch.zeros_like(x)
    start = 0
    for n in lengths:
        for t in range(start, start + n):
            acc = bias.double().clone() if bias is not None else torch.zeros(x.shape[1], dtype=torch.float64)
            for j in range(W):
                src = t - W + 1 + j
                if src >= start:
                    acc += weight[:, j] * x[src]
            out[t] = F.silu(acc)
        start += n
    return out[None]


def inputs(dtype=torch.float32, bias=True):
    T = sum(LENGTHS)
    x = torch.randn(1, T, C, dtype=dtype)
    w = torch.randn(C, W, dtype=dtype) * 0.5
    b = torch.randn(C, dtype=dtype) * 0.1 if bias else None
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return x, w, b, cu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_packed_matches_loop(dtype, bias, nan_poison):
    x, w, b, cu = inputs(dtype, bias)
    out = causal_conv1d(x, w, b, activation="silu", cu_seqlens=cu)
    assert out.dtype == dtype
    assert_rel_rms("conv1d", loop_formula(x, w, b, LENGTHS), out, 1e-6 if dtype == torch.float32 else 1e-2)


def test_batch_rows_equal_torch_conv_and_no_cross_sequence_leak():
    x, w, _, cu = inputs()
    # unpacked batch: each row one sequence, equal to transformers' torch path (padded nn.Conv1d, truncated)
    xb = torch.randn(3, 7, C)
    conv = torch.nn.Conv1d(C, C, W, groups=C, bias=False, padding=W - 1)
    with torch.no_grad():
        conv.weight.copy_(w.unsqueeze(1))
        hf = F.silu(conv(xb.transpose(1, 2))[..., :7]).transpose(1, 2)
    assert_rel_rms("batch", hf, causal_conv1d(xb, w, None), 1e-6)
    # perturbing sequence 2 changes nothing outside it
    out = causal_conv1d(x, w, None, cu_seqlens=cu)
    x2 = x.clone()
    x2[:, cu[2] : cu[3]] += 10.0
    out2 = causal_conv1d(x2, w, None, cu_seqlens=cu)
    outside = torch.ones(x.shape[1], dtype=torch.bool)
    outside[cu[2] : cu[3]] = False
    assert torch.equal(out[:, outside], out2[:, outside])
    assert not torch.equal(out[:, ~outside], out2[:, ~outside])


def test_gradients_match_fp64():
    x, w, b, cu = inputs()
    dy = torch.randn_like(x)
    args64 = [t.double().requires_grad_() for t in (x, w, b)]
    ref = torch.autograd.grad((loop_formula(*args64, LENGTHS) * dy.double()).sum(), args64)
    args32 = [t.clone().requires_grad_() for t in (x, w, b)]
    got = torch.autograd.grad((causal_conv1d(*args32, cu_seqlens=cu) * dy).sum(), args32)
    for name, r, g in zip(("dx", "dw", "dbias"), ref, got):
        assert_rel_rms(name, r, g, 1e-5)


def test_bad_inputs_raise():
    x, w, b, cu = inputs()
    with pytest.raises(ValueError, match="non-decreasing"):
        causal_conv1d(x, w, b, cu_seqlens=torch.tensor([0, 9, 4, 18], dtype=torch.int32))
    with pytest.raises(ValueError, match="ends at"):
        causal_conv1d(x, w, b, cu_seqlens=torch.tensor([0, 5, 17], dtype=torch.int32))
    with pytest.raises(ValueError, match="B == 1"):
        causal_conv1d(x.expand(2, -1, -1), w, b, cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"weight must be \[C, W\]"):
        causal_conv1d(x, w[:-1], b)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, w, b, activation="gelu")


def test_reference_empty_sequences_and_no_tokens():
    """An empty packed sequence, or T == 0, gives the correct (empty) result and gradients."""
    lengths = [3, 0, 7]
    x = torch.randn(1, 10, C, dtype=torch.float64, requires_grad=True)
    w = torch.randn(C, W, dtype=torch.float64, requires_grad=True)
    b = torch.randn(C, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    out = causal_conv1d_ref(x, w, b, cu_seqlens=cu)
    assert_rel_rms("out", loop_formula(x, w, b, lengths), out, 1e-12)
    dy = torch.randn_like(out)
    got = torch.autograd.grad((out * dy).sum(), (x, w, b))
    ref = torch.autograd.grad((loop_formula(x, w, b, lengths) * dy).sum(), (x, w, b))
    for name, r, g in zip(("dx", "dw", "dbias"), ref, got):
        assert_rel_rms(name, r, g, 1e-12)
    for x0, cu0 in ((torch.randn(2, 0, C), None), (torch.randn(1, 0, C), torch.tensor([0, 0], dtype=torch.int32))):
        x0.requires_grad_()
        out = causal_conv1d_ref(x0, w.float(), b.float(), cu_seqlens=cu0)
        assert out.shape == x0.shape
        dx, dw, db = torch.autograd.grad(out.sum(), (x0, w, b))
        assert dx.shape == x0.shape and not dw.any() and not db.any()


# ---- Triton kernels (interpreter on CPU) against the reference run in fp64 ----

TRITON_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def run_with_grads(fn, x, w, b, dy, activation, cu):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b) if t is not None]
    xl, wl, bl = leaves[0], leaves[1], leaves[2] if b is not None else None
    out = fn(xl, wl, bl, activation=activation, cu_seqlens=cu)
    return out, torch.autograd.grad((out.double() * dy.double()).sum(), leaves)


def check_triton(B, lengths_or_T, C_, dtype, bias=True, activation="silu", x=None, seed=0, W=W):
    """Out, dx, dweight (and dbias) of the Triton op against causal_conv1d_ref in fp64, on inputs
    drawn from `seed` (x unless given)."""
    torch.manual_seed(seed)
    if isinstance(lengths_or_T, list):
        T = sum(lengths_or_T)
        cu = torch.tensor([0, *torch.tensor(lengths_or_T).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    else:
        T, cu = lengths_or_T, None
    x = torch.randn(B, T, C_, device=DEV).to(dtype) if x is None else x
    w = (torch.randn(C_, W, device=DEV) * 0.5).to(dtype)
    b = (torch.randn(C_, device=DEV) * 0.1).to(dtype) if bias else None
    dy = torch.randn(B, T, C_, device=DEV).to(dtype)
    out, grads = run_with_grads(lambda *a, **k: causal_conv1d(*a, impl="triton", **k), x, w, b, dy, activation, cu)
    assert out.dtype == dtype and grads[0].dtype == dtype and grads[1].dtype == dtype
    ref, ref_grads = run_with_grads(
        causal_conv1d_ref, x.double(), w.double(), None if b is None else b.double(), dy, activation, cu
    )
    tol = TRITON_TOL[dtype]
    for name, r, g in zip(("out", "dx", "dw", "dbias"), (ref, *ref_grads), (out, *grads)):
        if r.numel():
            assert_rel_rms(name, r, g, tol)
        else:
            assert g.shape == r.shape and not g.any(), name
    return out, grads


# Empty, length-1 and shorter-than-W sequences; one crossing the 64-row backward group boundary.
VARLEN = [5, 0, 1, 9, 3, 0, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_varlen_matches_fp64(dtype, nan_poison):
    check_triton(1, VARLEN, 72, dtype)  # C = 72: a partial channel block


def test_triton_long_rows_no_activation(nan_poison):
    # 150 rows: three backward row groups, sequence boundaries at and around the group edges 64, 128
    check_triton(1, [63, 1, 0, 64, 22], 8, torch.float32, activation=None)


def test_triton_no_bias_and_odd_widths(nan_poison):
    check_triton(1, [6, 1, 3], 8, torch.float32, bias=False)
    check_triton(1, [6, 1, 2], 8, torch.float32, W=3)
    check_triton(1, [4, 1], 8, torch.float32, W=1)


N_CONFIGS = 6  # the longest of conv.FWD_CONFIGS / BWD_DZ_CONFIGS / BWD_DX_CONFIGS (asserted below)


@pytest.mark.parametrize("i", range(1, N_CONFIGS))
def test_triton_every_config_matches_fp64(i, monkeypatch, nan_poison):
    """The interpreter runs the first config only (the other tests) and a GPU autotunes over all:
    run config i first."""
    from verl_moe.ops.conv1d import conv

    assert max(len(conv.FWD_CONFIGS), len(conv.BWD_DZ_CONFIGS), len(conv.BWD_DX_CONFIGS)) == N_CONFIGS
    monkeypatch.setattr(conv, "FWD_CONFIGS", [conv.FWD_CONFIGS[i % len(conv.FWD_CONFIGS)]])
    for name in ("BWD_DZ_CONFIGS", "BWD_DX_CONFIGS"):
        configs = getattr(conv, name)
        monkeypatch.setattr(conv, name, [configs[i % len(configs)]])
    check_triton(1, [40, 1, 0, 30, 2], 8, torch.float32)  # 73 rows: two backward row groups


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_several_channel_blocks(dtype, monkeypatch, nan_poison):
    """The shipped backward tiles span 512-2048 channels, so C < 1024 here is one channel block: with
    16-channel tiles, C = 40 is three (the last partial), with dweight partials per block, W = 3."""
    from verl_moe.ops.conv1d import conv

    for name in ("BWD_DZ_CONFIGS", "BWD_DX_CONFIGS"):
        monkeypatch.setattr(conv, name, [{**getattr(conv, name)[0], "BC": 16, "num_warps": 1}])
    check_triton(1, [5, 1, 0, 3, 9], 40, dtype, W=3)


def test_triton_batch_rows_and_no_tokens(nan_poison):
    check_triton(3, 7, 12, torch.float32)  # B > 1, no cu_seqlens: each row its own sequence
    check_triton(2, 0, 12, torch.float32)  # T == 0
    check_triton(1, [0], 12, torch.float32)  # one empty packed sequence


def test_triton_non_contiguous_input_and_determinism():
    x = torch.randn(1, 12, 40, device=DEV).transpose(1, 2).contiguous().transpose(1, 2)  # [1, 12, 40] strided
    assert not x.is_contiguous()
    out, grads = check_triton(1, [4, 8], 40, torch.float32, x=x)
    out2, grads2 = check_triton(1, [4, 8], 40, torch.float32, x=x.contiguous())
    assert torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))


def test_triton_refuses_fp64():
    x, w, b, cu = inputs()
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        causal_conv1d(x.double(), w.double(), b.double(), cu_seqlens=cu, impl="triton")
    with pytest.raises(ValueError, match="non-decreasing"):
        causal_conv1d(x, w, b, cu_seqlens=torch.tensor([0, 9, 4, 18], dtype=torch.int32), impl="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_qwen_shapes_match_fp64_and_are_deterministic(dtype):
    """Qwen3.5 GDN conv: C = 2 * 16 * 128 + 32 * 128 = 8192, W = 4, no bias, 8192 tokens in 65 sequences
    (with a length-1, an empty and a length-3 one)."""
    gen = torch.Generator().manual_seed(0)
    cuts = torch.randperm(8186, generator=gen)[:60].add(1).sort().values.tolist()  # in [1, 8186]
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, 8192 - 5])] + [1, 0, 3, 1]
    assert sum(lengths) == 8192
    runs = [check_triton(1, lengths, 8192, dtype, bias=False) for _ in range(2)]
    (out, grads), (out2, grads2) = runs
    assert torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))


# ---- several positions per sequence (`conv1d.positions`): T one-token steps in one call ----

PN, PT, PC, PW = 5, 3, 48, 4
COUNTS = [0, 1, PT - 1, PT, PT]  # a row that runs none, one, all but one, all
DTYPES = {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.bfloat16)}
# x fp32 with a bf16 state: an earlier position's input must come back rounded, as the state held it
MIXED = {**DTYPES, "fp32-x-bf16-state": (torch.float32, torch.bfloat16)}


def positions_inputs(x_dtype, state_dtype, seed=0, bias=True):
    """x [PN, PT, PC] as a column slice of a wider projection, weight, bias, state, counts."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(PN, PT, 3 * PC, generator=gen).to(DEV, x_dtype)
    x = wide[..., PC : 2 * PC]
    weight = (torch.randn(PC, PW, generator=gen) * 0.5).to(DEV, x_dtype)
    b = (torch.randn(PC, generator=gen) * 0.1).to(DEV, x_dtype) if bias else None
    state = torch.randn(PN, PC, PW - 1, generator=gen).to(DEV, state_dtype)
    return x, weight, b, state, torch.tensor(COUNTS, device=DEV)


def run_mask(counts, T=PT):
    """[N, T] True at the positions a row runs."""
    return torch.arange(T, device=counts.device)[None, :] < counts[:, None]


@pytest.mark.parametrize("small_tiles", [False, True], ids=["shipped-tiles", "16-channel-tiles"])
@pytest.mark.parametrize("with_counts", [True, False], ids=["counts", "all"])
@pytest.mark.parametrize("dtypes", MIXED.values(), ids=MIXED.keys())
def test_positions_kernel_equals_successive_steps(dtypes, with_counts, small_tiles, monkeypatch, nan_poison):
    """One launch over T positions gives bitwise what T one-token step launches give: the outputs at
    the positions each row runs and the advanced state (x a strided column slice; 16-channel tiles
    make C = 48 three channel blocks)."""
    from verl_moe.ops.conv1d import step_kernel
    from verl_moe.ops.conv1d.step_kernel import causal_conv1d_positions_triton, causal_conv1d_step_triton

    if small_tiles:
        monkeypatch.setattr(step_kernel, "STEP_CONFIGS", [{"BC": 16, "num_warps": 1}])
    x, weight, b, s0, counts = positions_inputs(*dtypes)
    if not with_counts:
        counts = torch.full((PN,), PT, device=DEV)
    state = s0.clone()
    out = causal_conv1d_positions_triton(x, state, weight, b, counts=counts if with_counts else None, advance=True)
    assert out.shape == (PN, PT, PC) and out.dtype == x.dtype
    steps = s0.clone()
    for t in range(PT):
        active = counts > t
        o, _ = causal_conv1d_step_triton(x[:, t], steps, weight, b, active=active, inplace=True)
        assert torch.equal(out[active, t], o[active]), f"position {t}"
    assert torch.equal(state, steps)
    assert torch.equal(state[counts == 0], s0[counts == 0]) and not torch.equal(state[counts > 0], s0[counts > 0])


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_positions_without_advance_and_idle_nan_row(impl):
    """advance=False never writes the state; with advance, a row that runs no position and holds NaN
    keeps its state bitwise (bf16 x over an fp32 state: a rewrite would round it) and changes nothing
    in any other row."""
    from verl_moe.ops.dispatch import resolve

    positions = resolve("conv1d.positions", impl)
    x, weight, b, s0, counts = positions_inputs(torch.bfloat16, torch.float32)
    state = s0.clone()
    out = positions(x, state, weight, b, counts=counts)
    assert torch.equal(state, s0)
    clean = s0.clone()
    out_clean = positions(x, clean, weight, b, counts=counts, advance=True)
    run = run_mask(counts)
    assert torch.equal(out_clean[run], out[run])
    assert torch.equal(clean[counts == 0], s0[counts == 0])  # kept bitwise, not rewritten
    idle, others = 0, counts != 0
    assert counts[idle] == 0
    s_nan = s0.clone()
    s_nan[idle] = float("nan")
    state = s_nan.clone()
    out_nan = positions(x, state, weight, b, counts=counts, advance=True)
    assert not out_nan[others].isnan().any() and torch.equal(out_nan[others], out_clean[others])
    assert torch.equal(state[others], clean[others])
    assert torch.equal(state[idle].view(torch.int32), s_nan[idle].view(torch.int32))  # bitwise, NaN included


def windows_fp64(x, state, weight, bias, counts):
    """Each position's output from its explicit window of [state | x] in fp64, and the state after
    counts[n] positions (the last W-1 inputs up to there)."""
    seq = torch.cat([state.double(), x.double().transpose(1, 2)], dim=-1)  # [N, C, W-1+T], oldest first
    W = weight.shape[1]
    acc = torch.stack([(seq[..., t : t + W] * weight.double()).sum(-1) for t in range(x.shape[1])], dim=1)
    if bias is not None:
        acc = acc + bias.double()
    new_state = torch.stack([seq[n, :, c : c + W - 1] for n, c in enumerate(counts.tolist())])
    return F.silu(acc), new_state


TORCH_TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}
TORCH_VS_TRITON_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtypes", DTYPES.values(), ids=DTYPES.keys())
def test_positions_torch_matches_fp64_windows_and_triton(dtypes, bias):
    """The torch form against an fp64 computation of each position's window; the Triton and exact
    forms against the torch form (outputs within tolerance at run positions, states bitwise)."""
    from verl_moe.ops.dispatch import resolve

    x, weight, b, s0, counts = positions_inputs(*dtypes, seed=1, bias=bias)
    run = run_mask(counts)
    ref_out, ref_state = windows_fp64(x, s0, weight, b, counts)
    state = s0.clone()
    out = resolve("conv1d.positions", "torch")(x, state, weight, b, counts=counts, advance=True)
    assert out.dtype == x.dtype
    assert_rel_rms("torch positions out", ref_out[run], out[run], TORCH_TOL[x.dtype])
    assert torch.equal(state.double(), ref_state)  # the state holds inputs: no arithmetic
    for impl in ("triton", "exact"):
        other = s0.clone()
        got = resolve("conv1d.positions", impl)(x, other, weight, b, counts=counts, advance=True)
        assert_rel_rms(f"{impl} positions out", out[run], got[run], TORCH_VS_TRITON_TOL[x.dtype])
        assert torch.equal(other, state), impl


def test_positions_bad_inputs_raise():
    from verl_moe.ops.conv1d.positions import causal_conv1d_positions_ref
    from verl_moe.ops.conv1d.step_kernel import causal_conv1d_positions_triton

    x, weight, b, s0, counts = positions_inputs(torch.float32, torch.float32)
    for fn in (causal_conv1d_positions_ref, causal_conv1d_positions_triton):
        with pytest.raises(ValueError, match=r"x must be \[N, T, C\]"):
            fn(x[:, 0], s0, weight, b)
        with pytest.raises(ValueError, match=r"conv_state must be"):
            fn(x, s0[:-1], weight, b)
        with pytest.raises(ValueError, match="counts must be"):
            fn(x, s0, weight, b, counts=counts[:-1])
        with pytest.raises(ValueError, match="counts must be"):
            fn(x, s0, weight, b, counts=counts.float())
        with pytest.raises(ValueError, match="contiguous"):
            fn(x, s0.transpose(0, 1).contiguous().transpose(0, 1), weight, b, advance=True)
    with pytest.raises(ValueError, match="fp32"):
        causal_conv1d_positions_triton(x.double(), s0.double(), weight.double(), b.double())
