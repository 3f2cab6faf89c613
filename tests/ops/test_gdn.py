"""Gated delta rule: the references, and our Triton kernels against the fp64 recurrent reference.

On CPU the kernels run in the Triton interpreter at small shapes; the `gpu` tests repeat the
properties at Qwen3.5-35B shapes (H=16, HV=32, K=V=128) and compare with fla when installed.

Tolerances (relative RMS error vs the fp64 reference on the same inputs):

    dtype   o      final state   dq dk dv dh0   dg dbeta dA_log ddt_bias
    fp32    1e-3   1e-3          1e-3           1e-3
    fp16    3e-3   1e-2          1e-2           2e-2
    bf16    3e-3   1e-2          1e-2           2e-2
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from verl_moe.ops import device

if not device.is_accelerator():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from verl_moe.ops.compare import assert_rel_rms, rel_rms  # noqa: E402
from verl_moe.ops.gdn import chunk_gated_delta_rule as dispatched  # noqa: E402
from verl_moe.ops.gdn import l2norm, output, solve, state, wy  # noqa: E402
from verl_moe.ops.gdn import launch as gdn_launch  # noqa: E402
from verl_moe.ops.gdn.chunk import chunk_gated_delta_rule  # noqa: E402
from verl_moe.ops.gdn.reference import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref  # noqa: E402

TOL = {
    torch.float32: {
        "o": 1e-3,
        "ht": 1e-3,
        "dq": 1e-3,
        "dk": 1e-3,
        "dv": 1e-3,
        "dh0": 1e-3,
        "dg": 1e-3,
        "dbeta": 1e-3,
        "dA_log": 1e-3,
        "ddt_bias": 1e-3,
    },
    torch.bfloat16: {
        "o": 3e-3,
        "ht": 1e-2,
        "dq": 1e-2,
        "dk": 1e-2,
        "dv": 1e-2,
        "dh0": 1e-2,
        "dg": 2e-2,
        "dbeta": 2e-2,
        "dA_log": 2e-2,
        "ddt_bias": 2e-2,
    },
}
TOL[torch.float16] = TOL[torch.bfloat16]
DEV = device.current_device()


@pytest.fixture(autouse=True)
def _interpreter_rounds_to_nearest(monkeypatch):
    """Triton's interpreter truncates fp32 -> bf16 (its create_fp_trunc ignores the rounding mode)
    where hardware rounds to nearest even; truncation is biased and, measured here, makes the bf16
    error of o ~4x larger than on hardware. Patched for these tests so the CPU runs see the
    hardware's rounding (fp16 casts already go through numpy, which rounds to nearest)."""
    if not gdn_launch.interpreting():
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_fp_trunc

    def fp_trunc(self, src, dst_type):
        if dst_type.scalar != tl.bfloat16 or src.dtype.scalar != tl.float32:
            return original(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        nan = np.isnan(src.data)
        rounded[nan] = 0x7FC0
        return interpreter.TensorHandle(rounded, tl.bfloat16)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fp_trunc", fp_trunc)


def make_inputs(B, T, H, HV, K, V, dtype, gate="g", h0=True, N=None, seed=0, key_scale=1.0):
    """Leaf inputs in Qwen3.5's distributions: raw q/k (l2-normalised in the op), g from the gate."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEV)

    x = {
        "q": rnd(B, T, H, K).to(dtype),
        "k": rnd(B, T, H, K, scale=key_scale).to(dtype),
        "v": rnd(B, T, HV, V).to(dtype),
        "beta": torch.sigmoid(rnd(B, T, HV)).to(dtype),
    }
    if gate == "g":
        x["g"] = F.logsigmoid(rnd(B, T, HV))  # fp32 log-decay, as the model computes it
    else:
        x["a"], x["A_log"], x["dt_bias"] = rnd(B, T, HV).to(dtype), rnd(HV, scale=0.5), rnd(HV, scale=0.5)
    if h0:
        x["initial_state"] = rnd(N or B, HV, K, V, scale=0.5)
    return {name: t.requires_grad_() for name, t in x.items()}


def run_ours(x, cu_seqlens=None, l2norm=True, final=True, fn=chunk_gated_delta_rule):
    args = {n: t for n, t in x.items() if n not in ("q", "k", "v", "g", "beta")}
    return fn(
        x["q"],
        x["k"],
        x["v"],
        x.get("g"),
        x["beta"],
        output_final_state=final,
        use_qk_l2norm_in_kernel=l2norm,
        cu_seqlens=cu_seqlens,
        **args,
    )


def run_reference(x, cu_seqlens=None, l2norm=True, ref=recurrent_gated_delta_rule_ref):
    """The reference in fp64 on the same (rounded) inputs; the gate is computed in fp64 too."""
    r = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    g = r.get("g")
    if g is None:
        g = -r["A_log"].exp() * F.softplus(r["a"] + r["dt_bias"])
    o, ht = ref(
        r["q"],
        r["k"],
        r["v"],
        g,
        r["beta"],
        initial_state=r.get("initial_state"),
        output_final_state=True,
        use_qk_l2norm_in_kernel=l2norm,
        cu_seqlens=cu_seqlens,
    )
    return o, ht, r


GRAD_NAMES = {
    "q": "dq",
    "k": "dk",
    "v": "dv",
    "g": "dg",
    "beta": "dbeta",
    "initial_state": "dh0",
    "A_log": "dA_log",
    "dt_bias": "ddt_bias",
    "a": "dg",
}


def backward_pair(x, out, r, ref_out, seed=1):
    """Backprop the same random cotangents through ours and the reference."""
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(out[0].shape, generator=gen).to(DEV)
    dht = torch.randn(out[1].shape, generator=gen).to(DEV)
    ((out[0].float() * do).sum() + (out[1] * dht).sum()).backward()
    ((ref_out[0] * do.double()).sum() + (ref_out[1] * dht.double()).sum()).backward()


def check_against_reference(
    x, cu_seqlens=None, l2norm=True, dtype=torch.float32, ref=recurrent_gated_delta_rule_ref, dg_abs=None
):
    """Ours vs the fp64 reference: outputs, final states and every gradient by relative RMS error
    (printed, for `pytest -s`). dg_abs: compare dg by absolute RMS error instead (where the exact dg
    is ~0, e.g. decay to zero)."""
    tol = TOL[dtype]
    out = run_ours(x, cu_seqlens, l2norm)
    o_ref, ht_ref, r = run_reference(x, cu_seqlens, l2norm, ref=ref)
    assert out[0].dtype == x["q"].dtype and out[1].dtype == torch.float32
    print(f"\n{dtype} rel-RMS vs fp64: o {rel_rms(o_ref, out[0]):.2e} ht {rel_rms(ht_ref, out[1]):.2e}", end="")
    assert_rel_rms("o", o_ref, out[0], tol["o"])
    assert_rel_rms("ht", ht_ref, out[1], tol["ht"])
    backward_pair(x, out, r, (o_ref, ht_ref))
    for name, t in x.items():
        assert t.grad is not None, f"no gradient for {name}"
        assert t.grad.dtype == t.dtype and t.grad.shape == t.shape
        if dg_abs is not None and GRAD_NAMES[name] == "dg":
            assert torch.isfinite(t.grad).all()
            assert (t.grad.double() - r[name].grad).pow(2).mean().sqrt() <= dg_abs
            continue
        print(f" {GRAD_NAMES[name]} {rel_rms(r[name].grad, t.grad):.2e}", end="")
        assert_rel_rms(GRAD_NAMES[name], r[name].grad, t.grad, tol[GRAD_NAMES[name]])


# ---- references ---------------------------------------------------------------------------


@pytest.mark.parametrize("T,cu", [(130, None), (150, [0, 1, 66, 150])], ids=["T130", "varlen-1-65-84"])
def test_reference_chunk_equals_recurrent_fp64(T, cu):
    x = make_inputs(1, T, 2, 4, 16, 8, torch.float64, N=None if cu is None else len(cu) - 1)
    cu = None if cu is None else torch.tensor(cu, device=DEV)
    o_c, ht_c, _ = run_reference(x, cu, ref=chunk_gated_delta_rule_ref)
    o_r, ht_r, _ = run_reference(x, cu)
    assert rel_rms(o_r, o_c) <= 1e-10 and rel_rms(ht_r, ht_c) <= 1e-10


@pytest.mark.parametrize("fn", [chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref, chunk_gated_delta_rule])
def test_bad_inputs_raise_before_launch(fn, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched for invalid input")

    for mod in ("solve", "wy", "state", "output", "l2norm"):
        monkeypatch.setattr(f"verl_moe.ops.gdn.{mod}.launch", no_launch)
    x = {n: t.detach() for n, t in make_inputs(1, 8, 2, 4, 16, 16, torch.float32, h0=False).items()}
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    bad = [
        dict(q=q[..., :8]),  # q and k differ
        dict(v=v[:, :, :3]),  # HV not a multiple of H
        dict(g=g[..., :2]),  # g shape
        dict(cu_seqlens=torch.tensor([0, 5, 3, 8])),  # not monotone
        dict(cu_seqlens=torch.tensor([0, 4, 7])),  # does not end at T
        dict(cu_seqlens=torch.tensor([0.0, 8.0])),  # not integer
        dict(initial_state=torch.zeros(2, 4, 16, 16)),  # N mismatch
    ]
    for override in bad:
        args = dict(q=q, k=k, v=v, g=g, beta=beta) | override
        with pytest.raises(ValueError):
            fn(**args)
    if fn is chunk_gated_delta_rule:
        with pytest.raises(ValueError):  # K > 128
            fn(
                torch.zeros(1, 4, 1, 160),
                torch.zeros(1, 4, 1, 160),
                torch.zeros(1, 4, 1, 16),
                torch.zeros(1, 4, 1),
                torch.zeros(1, 4, 1),
            )
        with pytest.raises(ValueError):  # fp64 is the reference's job
            fn(q.double(), k.double(), v.double(), g, beta)
        with pytest.raises(ValueError):  # both g and a
            fn(q, k, v, g, beta, a=g, A_log=torch.zeros(4))
        with pytest.raises(ValueError):  # neither
            fn(q, k, v, None, beta)
        with pytest.raises(ValueError):  # A_log shape
            fn(q, k, v, None, beta, a=g, A_log=torch.zeros(2))


# ---- our kernels, CPU interpreter at small shapes (the same tests run on a GPU) ------------


@pytest.mark.parametrize("gate", ["g", "in_kernel"])
def test_fp32_matches_recurrent(gate, nan_poison):
    # K=96, V=80: non-power-of-two dims, two K blocks in the output backward, several V blocks.
    x = make_inputs(1, 130, 2, 4, 96 if gate == "g" else 16, 80 if gate == "g" else 32, torch.float32, gate)
    check_against_reference(x)


def _block_size_variants():
    """(config list, index) of every config whose block sizes differ from all earlier ones in its list.
    The interpreter runs a list's first config only; on a GPU the autotuner may pick any of them."""
    seen, cases = set(), []
    for module in (l2norm, solve, wy, state, output):
        for name, spec in module.KERNEL_LAUNCHES.items():
            configs = spec["configs"]
            if id(configs) in seen:  # shared by several kernels (the state forward and backward)
                continue
            seen.add(id(configs))
            metas = []
            for i, config in enumerate(configs):
                meta = {k: v for k, v in config.items() if k not in ("num_warps", "num_stages")}
                if meta not in metas:
                    metas.append(meta)
                    if i > 0:
                        cases.append(
                            pytest.param(configs, i, id=f"{name}-" + "-".join(f"{k}{v}" for k, v in meta.items()))
                        )
    return cases


@pytest.mark.parametrize("configs,index", _block_size_variants())
def test_every_block_size_config_matches_recurrent(configs, index, nan_poison):
    # Swapped to the front, so the interpreter runs it (for both kernels when a list is shared).
    configs[0], configs[index] = configs[index], configs[0]
    try:
        # K=96, V=80 and a 1-token sequence: partial K/V blocks and chunks at every block size.
        x = make_inputs(1, 130, 2, 4, 96, 80, torch.float32, N=3)
        check_against_reference(x, cu_seqlens=torch.tensor([0, 1, 66, 130], device=DEV))
    finally:
        configs[0], configs[index] = configs[index], configs[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16bit_matches_recurrent(dtype):
    x = make_inputs(1, 100, 2, 4, 32, 32, dtype, "in_kernel" if dtype == torch.bfloat16 else "g")
    check_against_reference(x, dtype=dtype)


def test_empty_batch_rows_pass_the_initial_state():
    """T == 0 without cu_seqlens (B empty rows): empty output, final state = initial state."""
    x = make_inputs(2, 0, 1, 2, 16, 16, torch.float32)
    o, final = run_ours(x)
    assert o.shape == (2, 0, 2, 16)
    assert torch.equal(final, x["initial_state"].float())


@pytest.mark.parametrize("T", [1, 65])
def test_short_sequences(T):
    x = make_inputs(2, T, 1, 2, 16, 16, torch.float32)
    check_against_reference(x, l2norm=False)


def test_varlen_equals_per_sequence_calls():
    cu = torch.tensor([0, 65, 66, 130], device=DEV, dtype=torch.int32)  # lengths 65, 1, 64
    x = make_inputs(1, 130, 1, 2, 16, 16, torch.float32, N=3)
    o, ht = run_ours(x, cu)
    gen = torch.Generator().manual_seed(3)
    do, dht = torch.randn(o.shape, generator=gen).to(DEV), torch.randn(ht.shape, generator=gen).to(DEV)
    ((o * do).sum() + (ht * dht).sum()).backward()
    for n, (s, e) in enumerate(zip(cu.tolist()[:-1], cu.tolist()[1:])):
        xs = {
            name: t.detach()[:, s:e].clone().requires_grad_()
            if name != "initial_state"
            else t.detach()[n : n + 1].clone().requires_grad_()
            for name, t in x.items()
        }
        o_s, ht_s = run_ours(xs)
        ((o_s * do[:, s:e]).sum() + (ht_s * dht[n : n + 1]).sum()).backward()
        assert_rel_rms(f"o seq{n}", o_s, o[:, s:e], 1e-6)
        assert_rel_rms(f"ht seq{n}", ht_s, ht[n : n + 1], 1e-6)
        for name, t in xs.items():
            full = x[name].grad[n : n + 1] if name == "initial_state" else x[name].grad[:, s:e]
            assert_rel_rms(f"{GRAD_NAMES[name]} seq{n}", t.grad, full, 1e-6)


def test_no_state_leak_across_sequences():
    cu = torch.tensor([0, 70, 100], device=DEV)
    x = {n: t.detach() for n, t in make_inputs(1, 100, 1, 2, 16, 16, torch.float32, h0=False).items()}
    o1, _ = run_ours(x, cu)
    y = dict(x)
    for name in ("q", "k", "v", "g", "beta"):
        y[name] = x[name].clone()
        y[name][:, :70] = y[name][:, :70] * 3 - 1
    o2, _ = run_ours(y, cu)
    assert not torch.equal(o1[:, :70], o2[:, :70])
    assert torch.equal(o1[:, 70:], o2[:, 70:])


@pytest.mark.parametrize("case", ["decay_to_zero", "beta_0_and_1", "big_keys_l2norm", "big_keys_raw"])
def test_numerical_stress_stays_finite(case):
    x = make_inputs(1, 80, 1, 2, 16, 16, torch.float32, key_scale=1e3 if case == "big_keys_l2norm" else 1.0)
    with torch.no_grad():
        if case == "decay_to_zero":
            x["g"].copy_(-1e4 * torch.rand_like(x["g"]))
        elif case == "beta_0_and_1":
            x["beta"].copy_((torch.rand_like(x["beta"]) > 0.5).float())
        elif case == "big_keys_raw":
            # Without l2norm the delta rule is only stable for beta |k|^2 <= 2 (the state update's
            # eigenvalue 1 - beta |k|^2 stays in [-1, 1]); keys at that edge, beta = 1.
            x["k"].copy_(F.normalize(x["k"], dim=-1) * 2**0.5)
            x["beta"].fill_(1.0)
    # With decay to zero the exact dg is ~1e-8: fp32 rounding of its O(1) cancelling terms dominates.
    check_against_reference(x, l2norm=case != "big_keys_raw", dg_abs=1e-6 if case == "decay_to_zero" else None)


def test_bitwise_deterministic():
    x = make_inputs(1, 100, 1, 2, 16, 16, torch.bfloat16, "in_kernel")
    runs = []
    for _ in range(2):
        for t in x.values():
            t.grad = None
        o, ht = run_ours(x)
        ((o.float() * 1.5).sum() + ht.sum()).backward()
        runs.append([o, ht] + [t.grad.clone() for t in x.values()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_deterministic_mode_searches_one_config(monkeypatch):
    """Across processes the autotuner may pick output-backward configs whose K blocks (BKB) differ,
    and with them the order of the log-decay sums; deterministic mode leaves it one config."""
    import triton.language as tl
    from verl_moe.ops.gdn.output import OUTPUT_BWD_CONFIGS

    assert len({c["BKB"] for c in OUTPUT_BWD_CONFIGS}) > 1
    bf16 = {"DT": tl.bfloat16}
    monkeypatch.delenv(device.DETERMINISTIC_ENV, raising=False)
    assert gdn_launch.search_configs(OUTPUT_BWD_CONFIGS, bf16) == OUTPUT_BWD_CONFIGS
    assert gdn_launch.search_configs(OUTPUT_BWD_CONFIGS, {"DT": tl.float32}) == OUTPUT_BWD_CONFIGS[:1]
    monkeypatch.setenv(device.DETERMINISTIC_ENV, "1")
    assert gdn_launch.search_configs(OUTPUT_BWD_CONFIGS, bf16) == OUTPUT_BWD_CONFIGS[:1]


def test_programs_loop_past_the_grid_limit(monkeypatch):
    x = make_inputs(1, 130, 1, 2, 16, 16, torch.float32)
    full = run_ours(x)
    from verl_moe.ops.common import launch as common_launch

    monkeypatch.setattr(common_launch, "GRID_LIMIT", 3)
    capped = run_ours(x)
    assert torch.equal(full[0], capped[0]) and torch.equal(full[1], capped[1])


def test_dispatch_resolves_triton():
    x = {n: t.detach() for n, t in make_inputs(1, 20, 1, 2, 16, 16, torch.float32).items()}
    o, ht = run_ours(x, fn=lambda *a, **k: dispatched(*a, impl="triton", **k))
    o_ref, ht_ref = run_ours(x)
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)


# ---- GPU: Qwen3.5-35B shapes --------------------------------------------------------------

QWEN = dict(H=16, HV=32, K=128, V=128)
MID = dict(H=8, HV=16, K=64, V=64)  # the mid-qwen3.5-moe align preset


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [QWEN, MID], ids=["qwen3.5-35b", "mid-preset"])
@pytest.mark.parametrize("dtype,gate", [(torch.bfloat16, "g"), (torch.bfloat16, "in_kernel"), (torch.float32, "g")])
def test_gpu_qwen_shapes_match_reference(dtype, gate, shape):
    x = make_inputs(2, 1000, dtype=dtype, gate=gate, **shape)
    # The chunked reference (equal to the recurrent one to 1e-10 in fp64, tested above) is faster.
    check_against_reference(x, dtype=dtype, ref=chunk_gated_delta_rule_ref)


@pytest.mark.gpu
@pytest.mark.gpu_memory
def test_gpu_varlen_many_short_sequences():
    lengths = [1, 63, 64, 65, 500, 7, 300] + [3] * 200
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=DEV)
    x = make_inputs(1, sum(lengths), dtype=torch.bfloat16, N=len(lengths), **QWEN)
    check_against_reference(x, cu, dtype=torch.bfloat16, ref=chunk_gated_delta_rule_ref)


@pytest.mark.gpu
@pytest.mark.gpu_memory
def test_gpu_long_bf16_stress_finite_and_deterministic():
    x = make_inputs(1, 65536, dtype=torch.bfloat16, gate="in_kernel", **QWEN)
    with torch.no_grad():
        x["a"][:, ::7].fill_(30.0)  # softplus(30) * exp(A_log): gates near -1e2, decay to zero
    runs = []
    for _ in range(2):
        for t in x.values():
            t.grad = None
        o, ht = run_ours(x)
        (o.float().square().mean() + ht.square().mean()).backward()
        runs.append([o, ht] + [t.grad.clone() for t in x.values()])
    for t in runs[0]:
        assert torch.isfinite(t).all()
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def _fla_first_configs_only():
    """fla's first call autotunes about 80 kernel configs, minutes on a GPU (past the test's time); a
    correctness comparison needs one config per kernel, so each
    fla autotuner keeps its first. (`verl-moe bench gdn` times fla fully autotuned.)"""
    from triton.runtime.autotuner import Autotuner

    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for obj in list(vars(module).values()):
            for _ in range(4):  # heuristics -> autotuner -> jit function
                if isinstance(obj, Autotuner):
                    obj.configs = obj.configs[:1]
                    break
                obj = getattr(obj, "fn", None)
                if obj is None:
                    break


@pytest.mark.gpu
def test_gpu_matches_fla():
    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    import fla.ops.common.chunk_o as fla_chunk_o

    # fla 0.6 refuses its backward on Hopper with Triton < 3.7.1 (a guard against a miscompile it
    # saw at some tile sizes); its gradients are checked against the fp64 reference here.
    fla_chunk_o.TRITON_ABOVE_3_7_1 = True
    _fla_first_configs_only()
    x = make_inputs(2, 2048, dtype=torch.bfloat16, **QWEN)
    y = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    out = run_ours(x)
    out_fla = fla.chunk_gated_delta_rule(
        y["q"],
        y["k"],
        y["v"],
        y["g"],
        y["beta"],
        initial_state=y["initial_state"],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    o_ref, ht_ref, r = run_reference(x, ref=chunk_gated_delta_rule_ref)
    backward_pair(x, out, r, (o_ref, ht_ref))
    gen = torch.Generator().manual_seed(1)  # the cotangents backward_pair used
    do, dht = torch.randn(out[0].shape, generator=gen).to(DEV), torch.randn(out[1].shape, generator=gen).to(DEV)
    ((out_fla[0].float() * do).sum() + (out_fla[1] * dht).sum()).backward()
    tol = TOL[torch.bfloat16]
    pairs = [("o", o_ref, out_fla[0], out[0])] + [
        (GRAD_NAMES[name], r[name].grad, y[name].grad, x[name].grad) for name in x
    ]
    for what, ref, theirs, ours in pairs:
        errs = rel_rms(ref, ours), rel_rms(ref, theirs), rel_rms(theirs, ours)
        print(
            f"\n{what}: rel-RMS ours vs fp64 {errs[0]:.2e}, fla vs fp64 {errs[1]:.2e}, ours vs fla {errs[2]:.2e}",
            end="",
        )
    failures = []
    for what, ref, theirs, ours in pairs:
        checks = [(f"{what} ours vs reference", ref, ours)]
        if what == "o":
            # fla's own bf16 o can be further from fp64 than the o budget, so ours-vs-fla cannot be
            # held to it; ours must be at least as close to fp64 as fla.
            ours_err, fla_err = rel_rms(ref, ours), rel_rms(ref, theirs)
            if ours_err > fla_err:
                failures.append(f"o: ours {ours_err:.2e} is further from fp64 than fla {fla_err:.2e}")
        else:
            # fla's backward runs past its own Hopper guard here, so its gradients must match the reference.
            checks += [(f"{what} ours vs fla", theirs, ours), (f"{what} fla vs reference", ref, theirs)]
        for name, a, b in checks:
            try:
                assert_rel_rms(name, a, b, tol[what])
            except AssertionError as e:
                failures.append(str(e))
    assert not failures, "\n".join(failures)
