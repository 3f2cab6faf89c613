"""The causal conv1d's decode step in one Triton kernel: one token (`resolve("conv1d.step")`'s "triton",
the cuda/npu default; contract as `step.causal_conv1d_step_ref`) or T positions per sequence in one
launch (`resolve("conv1d.positions")`'s "triton"; contract as `positions.causal_conv1d_positions_ref`).

One tile = (sequence, block of BC channels): its state [BC, W-1] and inputs are read, the T outputs
written, and the new state written once at the end (not at all for a sequence that runs no position).
A decode step of the reduced Qwen3.5-MoE (256 sequences x 8192 channels, W = 4) moves ~25 MB here;
torch's form (cat, multiply, sum, where, copy) moves several times that in ~6 kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.launch import cdiv, grid_1d, launch, next_pow2
from .positions import check_conv1d_positions_inputs
from .step import check_conv1d_step_inputs

STEP_CONFIGS = [
    {"BC": 128, "num_warps": 4},
    {"BC": 256, "num_warps": 4},
    {"BC": 64, "num_warps": 2},
]
MAX_SHAPES = ({"N": 4096, "C": 16384, "W": 4, "T": 8},)


@triton.jit
def _conv1d_step_kernel(
    x,
    state,
    weight,
    bias,
    out,
    new_state,
    counts,
    N,
    C,
    s_xn,
    s_xt,
    T: tl.constexpr,
    W: tl.constexpr,
    BW: tl.constexpr,
    BC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
    WRITE_STATE: tl.constexpr,
):
    """T positions of each sequence from its state. Position t's window column j is input s = t - (W-1) + j:
    state column W-1+s for s < 0, else x at position s, in x's dtype as the reference concatenates them
    (an earlier position's input rounded through the state's dtype, as the state would have held it);
    out = act(bias + window[:, 0] * weight[:, 0] + ...) in fp32, the taps in order as the packed forward
    adds them, so every output is bitwise the one-token step's (T = 1) and that kernel's.
    A row runs its first counts[n] positions (all T without counts); outputs past them are computed all
    the same. With WRITE_STATE the new state, the last W-1 inputs up to counts[n], is stored once (not at
    all for a row with none): new_state may be state itself, as a tile makes all of its loads before that store."""
    i_p, n_p = tl.program_id(0), tl.num_programs(0)
    NC = tl.cdiv(C, BC)
    o_w = tl.arange(0, BW)
    for i_t in range(i_p, N * NC, n_p):
        i_n, i_c = i_t // NC, i_t % NC
        o_c = i_c * BC + tl.arange(0, BC)
        m_c = o_c < C
        p_x = i_n.to(tl.int64) * s_xn + o_c  # each channel's input at position 0
        p_s0 = i_n.to(tl.int64) * C * (W - 1) + o_c * (W - 1)  # each channel's oldest state column
        for t in tl.static_range(T):
            # the packed forward's arithmetic (`conv._conv1d_pre`): the bias, then the taps added in order
            b_o = tl.zeros([BC], dtype=tl.float32)
            if HAS_BIAS:
                b_o += tl.load(bias + o_c, mask=m_c, other=0.0).to(tl.float32)
            for j in tl.static_range(W):
                s = t - (W - 1) + j  # the input tap j reads: a state column (s < 0) or a position of x
                b_s = tl.zeros([BC], dtype=tl.int32) + s  # a full block: the interpreter mistypes scalar masks
                b_st = tl.load(state + p_s0 + (W - 1 + s), mask=m_c & (b_s < 0), other=0.0).to(x.dtype.element_ty)
                b_in = tl.load(x + p_x + s * s_xt, mask=m_c & (b_s >= 0), other=0.0)
                b_in = tl.where(s < t, b_in.to(state.dtype.element_ty).to(b_in.dtype), b_in)
                b_win = tl.where(s < 0, b_st, b_in)
                b_o += b_win.to(tl.float32) * tl.load(weight + o_c * W + j, mask=m_c, other=0.0).to(tl.float32)
            if SILU:
                b_o = b_o * tl.sigmoid(b_o)
            tl.store(out + (i_n.to(tl.int64) * T + t) * C + o_c, b_o.to(out.dtype.element_ty), mask=m_c)
        if WRITE_STATE:
            # a full block of the row's run length (counts clamped to 0..T)
            if HAS_COUNTS:
                b_n = tl.zeros([BC, BW], dtype=tl.int32) + tl.load(counts + i_n).to(tl.int32)
                b_n = tl.minimum(tl.maximum(b_n, 0), T)
            else:
                b_n = tl.zeros([BC, BW], dtype=tl.int32) + T
            s_w = b_n - (W - 1) + o_w[None, :]  # the input the new state's column holds
            m_s = m_c[:, None] & (o_w[None, :] < W - 1)
            b_st = tl.load(state + p_s0[:, None] + (W - 1 + s_w), mask=m_s & (s_w < 0), other=0.0)
            b_in = tl.load(x + p_x[:, None] + s_w * s_xt, mask=m_s & (s_w >= 0), other=0.0)
            b_st = b_st.to(x.dtype.element_ty).to(new_state.dtype.element_ty)
            b_next = tl.where(s_w < 0, b_st, b_in.to(new_state.dtype.element_ty))
            tl.store(new_state + p_s0[:, None] + o_w[None, :], b_next, mask=m_s & (b_n > 0))


def _step_grid(meta: dict) -> tuple[int]:
    return grid_1d(meta["N"] * cdiv(meta["C"], meta["BC"]))


KERNEL_LAUNCHES = {
    "_conv1d_step_kernel": {
        "configs": STEP_CONFIGS,
        "meta": lambda shape: {"BW": next_pow2(shape["W"]), "T": shape["T"]},
        "grid": _step_grid,
        "runtime": lambda shape: {},
        "max_shapes": MAX_SHAPES,
    },
}


def _launch_step_kernel(x, state, weight, bias, activation, out, new_state, counts, *, T, s_xt, write_state, inplace):
    """One launch of `_conv1d_step_kernel` over the N rows of `out` ([N, T, C] or, T = 1, [N, C]); inplace:
    new_state is state, which an autotuning search restores after each trial."""
    launch(
        _conv1d_step_kernel,
        # one config with counts: a search would time whatever counts the first call brings
        STEP_CONFIGS[:1] if counts is not None else STEP_CONFIGS,
        ["C", "W", "T"],
        _step_grid,
        restore=("new_state",) if inplace else (),
        x=x,
        state=state,
        weight=weight,
        bias=bias.contiguous() if bias is not None else x,  # never read without HAS_BIAS
        out=out,
        new_state=new_state,
        counts=counts.contiguous() if counts is not None else x,  # never read without HAS_COUNTS
        N=out.shape[0],
        C=out.shape[-1],
        s_xn=x.stride(0),
        s_xt=s_xt,
        T=T,
        W=weight.shape[1],
        BW=next_pow2(weight.shape[1]),
        HAS_BIAS=bias is not None,
        SILU=activation is not None,
        HAS_COUNTS=counts is not None,
        WRITE_STATE=write_state,
    )


def _check_triton_step(x, weight) -> None:
    if x.dtype == torch.float64:
        raise ValueError("the Triton conv1d step computes in fp32: use impl 'torch' for fp64")
    if weight.shape[1] < 2:
        raise ValueError(f"the Triton conv1d step needs a conv width >= 2, got {weight.shape[1]}")


def causal_conv1d_step_triton(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    active: torch.Tensor | None = None,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv1d_step_ref` in one kernel (fp32 math): the kernel's T = 1 case, `active` as counts of
    0 or 1. Raises ValueError as it does, and for fp64 inputs, a width below 2 or an in-place state that
    is not contiguous."""
    check_conv1d_step_inputs(x, conv_state, weight, bias, activation, active)
    _check_triton_step(x, weight)
    if inplace and not conv_state.is_contiguous():
        raise ValueError("an in-place step needs a contiguous conv_state")
    N, C = x.shape
    # x may be a column slice of a joined projection (row stride above C): read in place, not copied
    x = x if x.stride(-1) == 1 else x.contiguous()
    state, weight = conv_state.contiguous(), weight.contiguous()
    out = torch.empty(N, C, dtype=x.dtype, device=x.device)
    new_state = state if inplace else torch.empty_like(state)
    if active is not None and not inplace:
        new_state.copy_(state)  # inactive rows keep theirs: the kernel skips their stores
    if N == 0:
        return out, new_state
    counts = active.contiguous().view(torch.uint8) if active is not None else None
    _launch_step_kernel(
        x, state, weight, bias, activation, out, new_state, counts, T=1, s_xt=0, write_state=True, inplace=inplace
    )
    return out, new_state


def causal_conv1d_positions_triton(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    counts: torch.Tensor | None = None,
    advance: bool = False,
) -> torch.Tensor:
    """`positions.causal_conv1d_positions_ref` in one launch (fp32 math): outputs and advanced state
    bitwise those of T successive `causal_conv1d_step_triton` calls. Raises ValueError as it does, and
    for fp64 inputs or a width below 2."""
    check_conv1d_positions_inputs(x, conv_state, weight, bias, activation, counts, advance)
    _check_triton_step(x, weight)
    N, T, C = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()  # other strides are read in place
    out = torch.empty(N, T, C, dtype=x.dtype, device=x.device)
    if N == 0 or T == 0:
        return out
    state = conv_state if advance else conv_state.contiguous()  # advance: contiguous, written in place
    _launch_step_kernel(
        x,
        state,
        weight.contiguous(),
        bias,
        activation,
        out,
        state,
        counts,
        T=T,
        s_xt=x.stride(1),
        write_state=advance,
        inplace=advance,
    )
    return out


__all__ = ["KERNEL_LAUNCHES", "causal_conv1d_positions_triton", "causal_conv1d_step_triton"]
