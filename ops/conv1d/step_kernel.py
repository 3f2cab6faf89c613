"""The causal conv1d's one-token step in one Triton kernel (`resolve("conv1d.step")`'s "triton", the
cuda/npu default); contract as `step.causal_conv1d_step_ref`.

One tile = (sequence, block of BC channels): its state [BC, W-1] and this token's inputs are read
once, the output written, and the shifted window written back as the new state (not at all for an
inactive sequence). A decode step of the reduced Qwen3.5-MoE (256 sequences x 8192 channels, W = 4)
moves ~25 MB here; torch's form (cat, multiply, sum, where, copy) moves several times that in ~6 kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.launch import cdiv, grid_1d, launch, next_pow2
from .step import check_conv1d_step_inputs

STEP_CONFIGS = [
    {"BC": 128, "num_warps": 4},
    {"BC": 256, "num_warps": 4},
    {"BC": 64, "num_warps": 2},
]
MAX_SHAPES = ({"N": 4096, "C": 16384, "W": 4},)


@triton.jit
def _conv1d_step_kernel(
    x,
    state,
    weight,
    bias,
    out,
    new_state,
    active,
    N,
    C,
    s_xn,
    W: tl.constexpr,
    BW: tl.constexpr,
    BC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
):
    """window[c, j] = state[c, j] for j < W - 1, x[c] at j = W - 1 (in x's dtype, as the reference
    concatenates them); out = act(bias + window[:, 0] * weight[:, 0] + ...) in fp32, the taps in order as
    the packed forward adds them, so a token's output is bitwise that kernel's; new state = window[:, 1:].
    new_state may be state itself: a tile reads both of its loads before its one store."""
    i_p, n_p = tl.program_id(0), tl.num_programs(0)
    NC = tl.cdiv(C, BC)
    o_w = tl.arange(0, BW)
    for i_t in range(i_p, N * NC, n_p):
        i_n, i_c = i_t // NC, i_t % NC
        o_c = i_c * BC + tl.arange(0, BC)
        m_c = o_c < C
        b_x = tl.load(x + i_n.to(tl.int64) * s_xn + o_c, mask=m_c, other=0.0)
        p_s0 = i_n.to(tl.int64) * C * (W - 1) + o_c * (W - 1)  # each channel's oldest state column
        p_s = p_s0[:, None] + o_w[None, :]
        m_s = m_c[:, None] & (o_w[None, :] < W - 1)
        # the packed forward's arithmetic (`conv._conv1d_pre`): the bias, then the taps added in order
        b_o = tl.zeros([BC], dtype=tl.float32)
        if HAS_BIAS:
            b_o += tl.load(bias + o_c, mask=m_c, other=0.0).to(tl.float32)
        for j in tl.static_range(W - 1):
            b_col = tl.load(state + p_s0 + j, mask=m_c, other=0.0).to(b_x.dtype)
            b_o += b_col.to(tl.float32) * tl.load(weight + o_c * W + j, mask=m_c, other=0.0).to(tl.float32)
        b_o += b_x.to(tl.float32) * tl.load(weight + o_c * W + W - 1, mask=m_c, other=0.0).to(tl.float32)
        if SILU:
            b_o = b_o * tl.sigmoid(b_o)
        tl.store(out + i_n.to(tl.int64) * C + o_c, b_o.to(out.dtype.element_ty), mask=m_c)
        # the new state's column j is the window's column j + 1
        b_next = tl.load(state + p_s + 1, mask=m_c[:, None] & (o_w[None, :] < W - 2), other=0.0).to(b_x.dtype)
        b_next = tl.where(o_w[None, :] == W - 2, b_x[:, None], b_next)
        if HAS_ACTIVE:
            keep = tl.zeros([BC, BW], dtype=tl.int32) + tl.load(active + i_n).to(tl.int32)  # a full mask block
            m_s = m_s & (keep != 0)
        tl.store(new_state + p_s, b_next.to(new_state.dtype.element_ty), mask=m_s)


def _step_grid(meta: dict) -> tuple[int]:
    return grid_1d(meta["N"] * cdiv(meta["C"], meta["BC"]))


KERNEL_LAUNCHES = {
    "_conv1d_step_kernel": {
        "configs": STEP_CONFIGS,
        "meta": lambda shape: {"BW": next_pow2(shape["W"])},
        "grid": _step_grid,
        "runtime": lambda shape: {},
        "max_shapes": MAX_SHAPES,
    },
}


def causal_conv1d_step_triton(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    active: torch.Tensor | None = None,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv1d_step_ref` in one kernel (fp32 math). Raises ValueError as it does, and for fp64
    inputs, a width below 2 or an in-place state that is not contiguous."""
    check_conv1d_step_inputs(x, conv_state, weight, bias, activation, active)
    if x.dtype == torch.float64:
        raise ValueError("the Triton conv1d step computes in fp32: use impl 'torch' for fp64")
    N, C = x.shape
    W = weight.shape[1]
    if W < 2:
        raise ValueError(f"the Triton conv1d step needs a conv width >= 2, got {W}")
    if inplace and not conv_state.is_contiguous():
        raise ValueError("an in-place step needs a contiguous conv_state")
    # x may be a column slice of a joined projection (row stride above C): read in place, not copied
    x = x if x.stride(-1) == 1 else x.contiguous()
    state, weight = conv_state.contiguous(), weight.contiguous()
    out = torch.empty(N, C, dtype=x.dtype, device=x.device)
    new_state = state if inplace else torch.empty_like(state)
    if active is not None and not inplace:
        new_state.copy_(state)  # inactive rows keep theirs: the kernel skips their stores
    if N == 0:
        return out, new_state
    launch(
        _conv1d_step_kernel,
        # one config with an active mask: a search would time whatever mask the first call brings
        STEP_CONFIGS[:1] if active is not None else STEP_CONFIGS,
        ["C", "W"],
        _step_grid,
        restore=("new_state",) if inplace else (),
        x=x,
        state=state,
        weight=weight,
        bias=bias.contiguous() if bias is not None else x,  # never read without HAS_BIAS
        out=out,
        new_state=new_state,
        active=active.contiguous().view(torch.uint8) if active is not None else x,  # never read without HAS_ACTIVE
        N=N,
        C=C,
        s_xn=x.stride(0),
        W=W,
        BW=next_pow2(W),
        HAS_BIAS=bias is not None,
        SILU=activation is not None,
        HAS_ACTIVE=active is not None,
    )
    return out, new_state


__all__ = ["KERNEL_LAUNCHES", "causal_conv1d_step_triton"]
