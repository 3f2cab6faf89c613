"""The gated delta rule's one-token step in one Triton kernel (`resolve("gdn.step")`'s "triton",
the cuda/npu default; contract and math as `step.gated_delta_rule_step`), and the same kernel over several
positions per row (`resolve("gdn.positions")`'s "triton": speculative decoding's verification and commit;
contract as `positions.gated_delta_rule_positions`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.launch import cdiv, grid_1d, launch, next_pow2
from .positions import check_gdn_positions_inputs
from .step import check_gdn_step_inputs, rows_of_contiguous_heads

# First: the fastest at a decode step's shape (256 rows x 32 heads x 128 x 128), the others slower in
# the order listed (docs/ops.md, decode steps). It alone runs with an active mask (see the launch).
STEP_CONFIGS = [
    {"BV": 64, "num_warps": 4},
    {"BV": 32, "num_warps": 2},
    {"BV": 16, "num_warps": 1},
]
MAX_K = 128  # the whole K of a state tile lives in one program (Ascend: K/V tiles <= 128)
MAX_SHAPES = ({"N": 4096, "HV": 64, "K": 128, "V": 128},)  # T (positions per row) does not change the grid


@triton.jit
def _gdn_step_fwd_kernel(
    q,
    k,
    v,
    g,
    beta,
    state,
    o,
    new_state,
    counts,
    scale,
    N,
    s_q,
    s_k,
    s_v,
    s_qt,
    s_kt,
    s_vt,
    T: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
    WRITE_STATE: tl.constexpr,
):
    """q, k [N, T, H, K], v [N, T, HV, V] with row strides s_q, s_k, s_v and position strides s_qt, s_kt, s_vt
    (each position's heads contiguous); g, beta [N, T, HV]; o [N, T, HV, V]. One tile = (sequence, value head,
    block of BV value columns): its state S [K, BV] is read once, steps through the sequence's positions in
    order (the first counts[n] with HAS_COUNTS, else all T; o past them undefined), each step decayed,
    delta-updated with that position's k/v and read out with q, and is written once when WRITE_STATE (neither
    read nor written for a sequence of 0 positions). new_state may be state itself: a tile is read before it is
    written and no other tile reads it. 1-D grid of min(N * HV * cdiv(V, BV), 65535) programs, each looping
    over tiles."""
    i_p, n_p = tl.program_id(0), tl.num_programs(0)
    NV = tl.cdiv(V, BV)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    for i_t in range(i_p, N * HV * NV, n_p):
        i_nh, i_v = i_t // NV, i_t % NV
        i_n, i_hv = i_nh // HV, i_nh % HV
        i_h = i_hv // (HV // H)
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        p_s = i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
        m_s = m_k[:, None] & m_v[None, :]
        b_n = tl.zeros([BK, BV], dtype=tl.int32) + T  # positions this sequence runs, as a full mask block
        if HAS_COUNTS:  # a sequence of 0 positions (an idle row) has its state neither read nor written
            b_n = tl.zeros([BK, BV], dtype=tl.int32) + tl.load(counts + i_n).to(tl.int32)
            m_s = m_s & (b_n > 0)
        b_s = tl.load(state + p_s, mask=m_s, other=0.0).to(tl.float32)
        for t in tl.static_range(T):
            p_qk = i_n.to(tl.int64) * s_q + t * s_qt + i_h * K + o_k
            b_q = tl.load(q + p_qk, mask=m_k, other=0.0).to(tl.float32)
            b_k = tl.load(k + i_n.to(tl.int64) * s_k + t * s_kt + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            if USE_QK_L2NORM:
                b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 0) + 1e-6)
                b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 0) + 1e-6)
            b_q = b_q * scale
            p_vt = i_n.to(tl.int64) * s_v + t * s_vt + i_hv * V + o_v
            b_v = tl.load(v + p_vt, mask=m_v, other=0.0).to(tl.float32)
            p_gt = (i_n.to(tl.int64) * T + t) * HV + i_hv
            b_g = tl.load(g + p_gt).to(tl.float32)
            b_beta = tl.load(beta + p_gt).to(tl.float32)
            b_st = b_s * tl.exp(b_g)
            b_u = b_beta * (b_v - tl.sum(b_st * b_k[:, None], 0))
            b_st = b_st + b_k[:, None] * b_u[None, :]
            b_o = tl.sum(b_st * b_q[:, None], 0)
            tl.store(o + (p_gt * V + o_v), b_o.to(o.dtype.element_ty), mask=m_v)
            b_s = tl.where(b_n > t, b_st, b_s)  # past its count a sequence's state stays
        if WRITE_STATE:
            tl.store(new_state + p_s, b_s, mask=m_s)


def _step_grid(meta: dict) -> tuple[int]:
    return grid_1d(meta["N"] * meta["HV"] * cdiv(meta["V"], meta["BV"]))


KERNEL_LAUNCHES = {
    "_gdn_step_fwd_kernel": {
        "configs": STEP_CONFIGS,
        "meta": lambda shape: {"BK": next_pow2(shape["K"])},
        "grid": _step_grid,
        "runtime": lambda shape: {},
        "max_shapes": MAX_SHAPES,
    },
}


def gated_delta_rule_step_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    active: torch.Tensor | None = None,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_rule_step` in one Triton kernel (fp32 math and state; o in v's dtype).
    Raises ValueError as `gated_delta_rule_step`, and for fp64 inputs, K > 128 or an in-place
    state that is not contiguous."""
    check_gdn_step_inputs(q, k, v, g, beta, state, active, inplace)
    _check_kernel_inputs(q, v, state, inplace)
    N, HV, V = v.shape
    new_state = state if inplace else torch.empty(N, HV, *state.shape[2:], dtype=torch.float32, device=v.device)
    if active is not None and not inplace:
        new_state.copy_(state)  # inactive rows keep theirs: the kernel skips their stores
    # one position per row: an active flag is a count of 0 or 1
    counts = active.contiguous().view(torch.uint8) if active is not None else None
    o = _launch(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], state, new_state, counts, scale,
                use_qk_l2norm_in_kernel)  # fmt: skip
    return o[:, 0], new_state


def gated_delta_rule_positions_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    counts: torch.Tensor | None = None,
    advance: bool = False,
) -> torch.Tensor:
    """`positions.gated_delta_rule_positions` in one Triton kernel: each state tile is read once, steps through
    the row's positions in registers by the one-token step's arithmetic (so each position's o and the state
    it leaves are bitwise the step kernel's), and is written once when advancing. Raises ValueError as
    `gated_delta_rule_positions`, and for fp64 inputs, K > 128 or a state that is not contiguous."""
    check_gdn_positions_inputs(q, k, v, g, beta, state, counts, advance)
    _check_kernel_inputs(q, v, state, inplace=True)
    if counts is not None:
        counts = counts.contiguous()  # any integer dtype: the kernel converts what it loads (no cast launch)
    return _launch(q, k, v, g, beta, state, state, counts, scale, use_qk_l2norm_in_kernel, write_state=advance)


def _check_kernel_inputs(q, v, state, inplace) -> None:
    if v.dtype == torch.float64:
        raise ValueError("the Triton gdn step computes in fp32: use impl 'torch' for fp64")
    if q.shape[-1] > MAX_K:
        raise ValueError(f"the Triton gdn step holds K <= {MAX_K} per program, got K={q.shape[-1]}")
    if inplace and not state.is_contiguous():
        raise ValueError("an in-place step needs a contiguous state")


def _launch(q, k, v, g, beta, state, new_state, counts, scale, use_qk_l2norm, write_state=True) -> torch.Tensor:
    """The kernel over q, k [N, T, H, K], v [N, T, HV, V], g, beta [N, T, HV]: o [N, T, HV, V] in v's dtype;
    `new_state` written when write_state (it may be `state`)."""
    N, T, H, K = q.shape
    HV, V = v.shape[2:]
    q, k, v = rows_of_contiguous_heads(q, k, v)
    g, beta, state = (t.contiguous() for t in (g, beta, state))
    o = torch.empty(N, T, HV, V, dtype=v.dtype, device=v.device)
    if N == 0:
        return o
    launch(
        _gdn_step_fwd_kernel,
        # a search would time whatever counts the first call brings: a graph capture warms up with every row
        # idle (no stores), where the smallest tile wins and then runs the real steps slower
        STEP_CONFIGS[:1] if counts is not None else STEP_CONFIGS,
        ["T", "H", "HV", "K", "V"],
        _step_grid,
        restore=("new_state",) if write_state and new_state is state else (),  # a search must not step it twice
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        state=state,
        o=o,
        new_state=new_state,
        counts=counts if counts is not None else o,  # never read without HAS_COUNTS
        scale=K**-0.5 if scale is None else float(scale),
        N=N,
        s_q=q.stride(0),
        s_k=k.stride(0),
        s_v=v.stride(0),
        s_qt=q.stride(1),
        s_kt=k.stride(1),
        s_vt=v.stride(1),
        T=T,
        H=H,
        HV=HV,
        K=K,
        V=V,
        BK=next_pow2(K),
        USE_QK_L2NORM=use_qk_l2norm,
        HAS_COUNTS=counts is not None,
        WRITE_STATE=write_state,
    )
    return o


__all__ = ["KERNEL_LAUNCHES", "gated_delta_rule_positions_triton", "gated_delta_rule_step_triton"]
