"""The gated delta rule's one-token step in one Triton kernel (`resolve("gdn.step")`'s "triton",
the cuda/npu default); contract and math as `step.gated_delta_rule_step`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.launch import cdiv, grid_1d, launch, next_pow2
from .step import check_gdn_step_inputs, rows_of_contiguous_heads

# First: the fastest at a decode step's shape (256 rows x 32 heads x 128 x 128), the others slower in
# the order listed (docs/ops.md, decode steps). It alone runs with an active mask (see the launch).
STEP_CONFIGS = [
    {"BV": 64, "num_warps": 4},
    {"BV": 32, "num_warps": 2},
    {"BV": 16, "num_warps": 1},
]
MAX_K = 128  # the whole K of a state tile lives in one program (Ascend: K/V tiles <= 128)
MAX_SHAPES = ({"N": 4096, "HV": 64, "K": 128, "V": 128},)


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
    active,
    scale,
    N,
    s_q,
    s_k,
    s_v,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
):
    """q, k [N, H, K], v [N, HV, V] with row strides s_q, s_k, s_v (each row's heads contiguous).
    One tile = (sequence, value head, block of BV value columns): its state S [K, BV] is read,
    decayed, delta-updated with this token's k/v, read out with q and written once (neither read nor
    written for an inactive sequence). new_state may be state itself: a tile is read before it is written and
    no other tile reads it. 1-D grid of min(N * HV * cdiv(V, BV), 65535) programs, each looping
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
        p_qk = i_h * K + o_k
        b_q = tl.load(q + i_n.to(tl.int64) * s_q + p_qk, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + i_n.to(tl.int64) * s_k + p_qk, mask=m_k, other=0.0).to(tl.float32)
        if USE_QK_L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 0) + 1e-6)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 0) + 1e-6)
        b_q = b_q * scale
        b_v = tl.load(v + i_n.to(tl.int64) * s_v + i_hv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + i_nh).to(tl.float32)
        b_beta = tl.load(beta + i_nh).to(tl.float32)
        p_s = i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
        m_s = m_k[:, None] & m_v[None, :]
        if HAS_ACTIVE:  # an idle row's state is neither read nor written (its o is undefined)
            keep = tl.zeros([BK, BV], dtype=tl.int32) + tl.load(active + i_n).to(tl.int32)  # a full mask block
            m_s = m_s & (keep != 0)
        b_s = tl.load(state + p_s, mask=m_s, other=0.0).to(tl.float32) * tl.exp(b_g)
        b_u = b_beta * (b_v - tl.sum(b_s * b_k[:, None], 0))
        b_s = b_s + b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_s * b_q[:, None], 0)
        tl.store(o + i_nh.to(tl.int64) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
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
    if v.dtype == torch.float64:
        raise ValueError("the Triton gdn step computes in fp32: use impl 'torch' for fp64")
    N, H, K = q.shape
    HV, V = v.shape[1:]
    if K > MAX_K:
        raise ValueError(f"the Triton gdn step holds K <= {MAX_K} per program, got K={K}")
    if inplace and not state.is_contiguous():
        raise ValueError("an in-place step needs a contiguous state")
    q, k, v = rows_of_contiguous_heads(q, k, v)
    g, beta, state = (t.contiguous() for t in (g, beta, state))
    o = torch.empty(N, HV, V, dtype=v.dtype, device=v.device)
    new_state = state if inplace else torch.empty(N, HV, K, V, dtype=torch.float32, device=v.device)
    if active is not None and not inplace:
        new_state.copy_(state)  # inactive rows keep theirs: the kernel skips their stores
    if N == 0:
        return o, new_state
    launch(
        _gdn_step_fwd_kernel,
        # a search would time whatever mask the first call brings: a graph capture warms up with every row
        # inactive (no stores), where the smallest tile wins and then runs the real steps slower
        STEP_CONFIGS[:1] if active is not None else STEP_CONFIGS,
        ["H", "HV", "K", "V"],
        _step_grid,
        restore=("new_state",) if inplace else (),  # the autotune search must not step the state twice
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        state=state,
        o=o,
        new_state=new_state,
        active=active.contiguous().view(torch.uint8) if active is not None else o,  # never read without HAS_ACTIVE
        scale=K**-0.5 if scale is None else float(scale),
        N=N,
        s_q=q.stride(0),
        s_k=k.stride(0),
        s_v=v.stride(0),
        H=H,
        HV=HV,
        K=K,
        V=V,
        BK=next_pow2(K),
        USE_QK_L2NORM=use_qk_l2norm_in_kernel,
        HAS_ACTIVE=active is not None,
    )
    return o, new_state


__all__ = ["KERNEL_LAUNCHES", "gated_delta_rule_step_triton"]
