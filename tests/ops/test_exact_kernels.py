"""Exact mode's Triton forms (`ops/*/exact_kernel.py`, and the fast kernels exact mode keeps on devices):
each row's result is bitwise independent of the rest of the call (other rows, their number, packed forward
vs decode step), and the values match the fp64 references. On CPU they run in the Triton interpreter at small sizes;
on a GPU in the real kernels, where the property is the point.

Tolerances (rel RMS against the fp64 reference on the same inputs; 16-bit operands of tensor-core dots on
devices, fp32 in the interpreter):
| form                         | fp32 | bf16 |
| linear, attention, gdn       | 1e-5 | 2e-2 |
| logsumexp, router weights    | 1e-6 |  -   |
"""

import pytest
import torch
from verl_moe.ops import device
from verl_moe.ops.attention.exact import attention_rows
from verl_moe.ops.attention.exact_kernel import attention_rows_triton
from verl_moe.ops.compare import assert_rel_rms
from verl_moe.ops.conv1d.conv import causal_conv1d as causal_conv1d_triton
from verl_moe.ops.conv1d.reference import causal_conv1d_ref
from verl_moe.ops.conv1d.step_kernel import causal_conv1d_step_triton
from verl_moe.ops.experts import moe_experts_ref
from verl_moe.ops.experts.exact import _experts_by_groups, decode_tiles_agree, exact_rows_configs
from verl_moe.ops.experts.grouped_gemm import SMALL_ROWS_CONFIGS
from verl_moe.ops.gdn import chunk_gated_delta_rule_ref
from verl_moe.ops.gdn.exact_kernel import gated_delta_rule_rows_triton
from verl_moe.ops.linear.exact_kernel import linear_rows_triton
from verl_moe.ops.logprob.exact_kernel import scaled_logsumexp_triton
from verl_moe.ops.norm.fused import rms_norm
from verl_moe.ops.norm.reference import rms_norm_ref
from verl_moe.ops.router.exact_kernel import route_rows_triton
from verl_moe.ops.router.reference import route_logits

DEV = device.device_type() if device.is_accelerator() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape) * scale).to(DEV, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K, N", [(80, 600), (128, 200), (128, 2600)])  # K partly or wholly in blocks; N's configs
def test_linear_rows_kernel_rows_are_their_own(dtype, K, N):
    """Rows in several row-block groups and column blocks: each row's result equals that row's alone."""
    torch.manual_seed(0)
    x, w, b = _randn(300, K, dtype=dtype), _randn(N, K, dtype=dtype), _randn(N, dtype=dtype)
    out = linear_rows_triton(x, w, b)
    assert_rel_rms("linear", x.double() @ w.double().T + b.double(), out, TOL[dtype])
    for rows in (slice(0, 1), slice(3, 4), slice(5, 30), slice(36, 37), slice(130, 299)):
        assert torch.equal(linear_rows_triton(x[rows], w, b), out[rows])
    wide = linear_rows_triton(x, w, out_dtype=torch.float32)
    assert wide.dtype == torch.float32 and torch.equal(
        linear_rows_triton(x[7:9], w, out_dtype=torch.float32), wide[7:9]
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_rows_kernel_packed_equals_decode_slots(dtype):
    """Rows of a packed batch (one cache, each row from its sequence's start) equal the same rows read from
    per-sequence slots of a larger cache, one row per call, bitwise; values equal the torch form's."""
    torch.manual_seed(1)
    H, HKV, K, V, L = 4, 2, 32, 16, 160
    lengths = [1, 70, 5, 130]
    T = sum(lengths)
    q, k, v = _randn(T, H, K, dtype=dtype), _randn(T, HKV, K, dtype=dtype), _randn(T, HKV, V, dtype=dtype)
    firsts = [sum(lengths[:i]) for i in range(len(lengths))]
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).to(DEV)
    starts = torch.tensor(firsts, device=DEV)[seq]
    pos = torch.cat([torch.arange(n) for n in lengths]).to(DEV)
    packed_k, packed_v = k.transpose(0, 1)[None].contiguous(), v.transpose(0, 1)[None].contiguous()
    zeros = torch.zeros_like(pos)
    packed = attention_rows_triton(q, packed_k, packed_v, zeros, starts, pos + 1, K**-0.5)
    reference = attention_rows(q.float(), packed_k.float(), packed_v.float(), zeros, starts, pos + 1, K**-0.5)
    assert_rel_rms("attention", reference.double(), packed, TOL[dtype])
    # slot, start and count given as columns of wider tensors (strided views): each row reads its own
    columns = [torch.stack([t, t.flip(0)], 1)[:, 0] for t in (zeros, starts, pos + 1)]
    assert torch.equal(attention_rows_triton(q, packed_k, packed_v, *columns, K**-0.5), packed)
    # the same keys in slots of a cache with room to spare, garbage past each sequence's end
    k_cache, v_cache = _randn(len(lengths), HKV, L, K, dtype=dtype), _randn(len(lengths), HKV, L, V, dtype=dtype)
    for n, (a, length) in enumerate(zip(firsts, lengths)):
        k_cache[n, :, :length] = k[a : a + length].transpose(0, 1)
        v_cache[n, :, :length] = v[a : a + length].transpose(0, 1)
    for row in (0, 1, 40, 75, 76, 150, T - 1):
        one = seq[row : row + 1]
        decoded = attention_rows_triton(
            q[row : row + 1], k_cache, v_cache, one, one * 0, pos[row : row + 1] + 1, K**-0.5
        )
        assert torch.equal(decoded[0], packed[row]), row


@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_rows_kernel_sequences_equal_token_steps(dtype):
    """The kernel over packed sequences gives each token the output (and each sequence the final state) of
    stepping it one token per call (the decode step's form: row n is sequence n) from the same state, bitwise;
    values match the chunked reference. The packed call reads q, k, v as the model hands them, head slices of
    one conv output (strided rows); the steps read contiguous copies."""
    torch.manual_seed(2)
    H, HV, K, V = 2, 4, 32, 48
    lengths = [3, 1, 9]
    T, N = sum(lengths), len(lengths)
    qkv = _randn(T, 2 * H * K + HV * V, dtype=dtype)
    q, k, v = (t.unflatten(-1, (-1, d)) for t, d in zip(qkv.split([H * K, H * K, HV * V], -1), (K, K, V)))
    assert not q.is_contiguous()
    g = -torch.rand(T, HV, device=DEV).to(dtype)
    beta = torch.rand(T, HV, device=DEV).to(dtype)
    state0 = _randn(N, HV, K, V, scale=0.1)
    starts = torch.tensor([0, 3, 4], device=DEV)
    o, final = gated_delta_rule_rows_triton(
        q, k, v, g, beta, state0, starts, torch.tensor(lengths, device=DEV), 0.3, True
    )
    cu = torch.tensor([0, 3, 4, 13], device=DEV)
    ref_o, ref_final = chunk_gated_delta_rule_ref(
        *(t[None].double() for t in (q, k, v, g, beta)),
        scale=0.3,
        initial_state=state0.double(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu,
    )
    assert_rel_rms("gdn o", ref_o[0], o, TOL[dtype])
    assert_rel_rms("gdn state", ref_final, final, TOL[dtype])
    state = state0.clone()
    for t in range(max(lengths)):
        active = torch.tensor([t < n for n in lengths], device=DEV)
        rows = (starts + t).clamp(max=T - 1)
        # a decode step's form: row n is sequence n, seq_len the active flags; an idle row's output is zeros
        step_o, state = gated_delta_rule_rows_triton(
            *(x[rows] for x in (q, k, v, g, beta)), state, None, active, 0.3, True
        )
        for n in range(N):
            if active[n]:
                assert torch.equal(step_o[n], o[rows[n]]), (t, n)
            else:
                assert not step_o[n].any(), (t, n)
    assert torch.equal(state, final)


def test_router_kernel_matches_reference_per_row():
    torch.manual_seed(3)
    logits = _randn(29, 24)
    for norm in (True, False):
        _, weight, idx = route_rows_triton(logits, 5, norm)
        _, ref_weight, ref_idx = route_logits(logits.double(), 5, norm)
        assert torch.equal(idx, ref_idx)
        assert_rel_rms("router weights", ref_weight, weight, 1e-6)
        _, part_weight, part_idx = route_rows_triton(logits[3:4], 5, norm)
        assert torch.equal(part_weight, weight[3:4]) and torch.equal(part_idx, idx[3:4])


def test_logsumexp_kernel_rows_are_their_own():
    torch.manual_seed(4)
    logits, inv_t = _randn(6, 9000, scale=4.0), torch.rand(6, device=DEV) + 0.5
    lse = scaled_logsumexp_triton(logits, inv_t)
    assert_rel_rms("lse", torch.logsumexp(logits.double() * inv_t.double()[:, None], -1), lse, 1e-6)
    assert torch.equal(scaled_logsumexp_triton(logits[2:3], inv_t[2:3]), lse[2:3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_grouped_exact_rows_are_their_own(dtype):
    """The whole batch past the decode sizes (training tiles on a GPU), its slices within (decode tiles)."""
    torch.manual_seed(5)
    N, D, I, E, TOPK = 200, 32, 16, 6, 2  # 400 copies > SMALL_ROWS_PER_EXPERT * E
    hidden = _randn(N, D, dtype=dtype)
    gate_up, down = _randn(E, 2 * I, D, dtype=dtype, scale=0.2), _randn(E, D, I, dtype=dtype, scale=0.2)
    idx = torch.stack([torch.randperm(E)[:TOPK] for _ in range(N)]).to(DEV)
    weight = torch.rand(N, TOPK, device=DEV)
    out = _experts_by_groups(hidden, gate_up, down, idx, weight)
    ref = moe_experts_ref(*(t.double() for t in (hidden, gate_up, down)), idx, weight.double())
    assert_rel_rms("experts", ref, out, TOL[dtype] * 2)
    for rows in (slice(0, 1), slice(4, 11)):
        assert torch.equal(_experts_by_groups(hidden[rows], gate_up, down, idx[rows], weight[rows]), out[rows])


@pytest.mark.skipif(DEV != "cuda", reason="decode tiles are for cuda's shared memory (none fit elsewhere)")
def test_experts_decode_tiles_follow_the_probe():
    """A decode step's expert GEMMs run in fast mode's decode config where the probe finds its bits equal to the
    training config's, else in the training config; a training micro-batch's always in the training config.
    On Hopper (H100 / H200) the probe agrees."""
    agree = decode_tiles_agree(torch.bfloat16)
    training = exact_rows_configs(torch.bfloat16, 64 * 1024, 64)
    assert training != tuple(SMALL_ROWS_CONFIGS)
    assert exact_rows_configs(torch.bfloat16, 2048, 64) == (tuple(SMALL_ROWS_CONFIGS) if agree else training)
    if torch.cuda.get_device_capability() == (9, 0):
        assert agree


def test_norm_first_config_rows_are_their_own():
    torch.manual_seed(6)
    x, w = _randn(70, 96, dtype=torch.bfloat16), _randn(96, dtype=torch.bfloat16)
    out = rms_norm(x, w, 1e-6, True, first_config=True)
    assert_rel_rms("norm", rms_norm_ref(x.double(), w.double(), 1e-6, unit_offset=True), out, 1e-2)
    assert torch.equal(rms_norm(x[9:10], w, 1e-6, True, first_config=True), out[9:10])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_conv1d_kernels_packed_equals_steps(dtype, with_bias):
    """The Triton packed forward (exact mode's conv1d on devices) and the Triton step (its decode step)
    give each token bitwise the same output: stepping every sequence from a zero state, a batch of one
    position of each per call, reproduces the packed forward; values match the reference."""
    torch.manual_seed(7)
    C, W, lengths = 72, 4, [1, 9, 3, 6]
    x = _randn(1, sum(lengths), C, dtype=dtype)
    weight, bias = _randn(C, W, dtype=dtype), _randn(C, dtype=dtype) if with_bias else None
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    packed = causal_conv1d_triton(x, weight, bias, "silu", torch.tensor(cu, device=DEV, dtype=torch.int32), cu)
    ref = causal_conv1d_ref(x.double(), weight.double(), None if bias is None else bias.double(), "silu",
                            torch.tensor(cu, device=DEV, dtype=torch.int32), cu)  # fmt: skip
    assert_rel_rms("conv1d", ref, packed, TOL[dtype])
    state = torch.zeros(len(lengths), C, W - 1, device=DEV, dtype=dtype)
    for t in range(max(lengths)):
        live = [n for n, n_len in enumerate(lengths) if t < n_len]
        rows = x[0, [cu[n] + t for n in live]]
        out, state[live] = causal_conv1d_step_triton(rows, state[live], weight, bias, "silu")
        assert torch.equal(out, packed[0, [cu[n] + t for n in live]]), t
