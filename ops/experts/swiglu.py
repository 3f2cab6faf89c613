"""The experts' activation between the two grouped GEMMs, weighted by the router: one Triton kernel each
way.

Forward: a[s] = w[src[s]] * silu(h[s, :I]) * h[s, I:] for the expert-sorted rows s of the gate_up
output h [S, 2I] (gate columns first), with w the flat router weights [S] (fp32) and src the copy at
each sorted row; math in fp32, a in h's dtype. Weighting here, before the down projection (linear, so
sum_k w_k down(a_k) = sum_k down(w_k a_k)), leaves the combine an unweighted sum and spares saving the
[S, D] down output for the weights' gradient.
Backward (saves only h and w): with g, u the gate and up halves and da the gradient of a,
dw[src[s]] = <da[s], silu(g) u> (fp32), d gate = da w u sigmoid(g) (1 + g (1 - sigmoid(g))),
d up = da w silu(g).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..common.launch import cdiv, grid_1d, launch, next_pow2

# Rows per program and the column chunk; the first config is what the interpreter and deterministic
# mode run (row-wise elementwise work; the dw row sums run over the same chunks in every config only
# when BI is the same: BI is fixed per I by the meta, so every config gives the same bits).
SWIGLU_CONFIGS = [
    {"BR": 4, "num_warps": 4},
    {"BR": 8, "num_warps": 8},
    {"BR": 2, "num_warps": 4},
    {"BR": 16, "num_warps": 8},
]


@triton.jit(do_not_specialize=["n_rows"])
def _moe_swiglu_fwd_kernel(h, w, src, a, n_rows, I: tl.constexpr, BR: tl.constexpr, BI: tl.constexpr):
    """One program per block of BR rows (1-D grid, looping): a [rows, I] = w[src] * silu(gate) * up of
    h [rows, 2I], columns in chunks of BI."""
    i_p = tl.program_id(0)
    for i_blk in range(i_p, tl.cdiv(n_rows, BR), tl.num_programs(0)):
        o_r = (i_blk * BR + tl.arange(0, BR)).to(tl.int64)
        m_r = o_r < n_rows
        b_w = tl.load(w + tl.load(src + o_r, mask=m_r, other=0), mask=m_r, other=0.0).to(tl.float32)
        for i_i in range(0, I, BI):
            o_i = i_i + tl.arange(0, BI)
            m = m_r[:, None] & (o_i < I)[None, :]
            p = o_r[:, None] * (2 * I) + o_i[None, :]
            b_g = tl.load(h + p, mask=m, other=0.0).to(tl.float32)
            b_u = tl.load(h + p + I, mask=m, other=0.0).to(tl.float32)
            b_a = b_g * tl.sigmoid(b_g) * b_u * b_w[:, None]
            tl.store(a + o_r[:, None] * I + o_i[None, :], b_a.to(a.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["n_rows"])
def _moe_swiglu_bwd_kernel(da, h, w, src, dh, dw, n_rows, I: tl.constexpr, BR: tl.constexpr, BI: tl.constexpr):
    """One program per block of BR rows (1-D grid, looping): dh [rows, 2I] from da [rows, I] and h, and
    dw[src[row]] = <da, silu(gate) * up> in fp32 (src is a permutation: one write per slot)."""
    i_p = tl.program_id(0)
    for i_blk in range(i_p, tl.cdiv(n_rows, BR), tl.num_programs(0)):
        o_r = (i_blk * BR + tl.arange(0, BR)).to(tl.int64)
        m_r = o_r < n_rows
        b_src = tl.load(src + o_r, mask=m_r, other=0)
        b_w = tl.load(w + b_src, mask=m_r, other=0.0).to(tl.float32)
        b_dw = tl.zeros([BR], dtype=tl.float32)
        for i_i in range(0, I, BI):
            o_i = i_i + tl.arange(0, BI)
            m = m_r[:, None] & (o_i < I)[None, :]
            p = o_r[:, None] * (2 * I) + o_i[None, :]
            b_g = tl.load(h + p, mask=m, other=0.0).to(tl.float32)
            b_u = tl.load(h + p + I, mask=m, other=0.0).to(tl.float32)
            b_da = tl.load(da + o_r[:, None] * I + o_i[None, :], mask=m, other=0.0).to(tl.float32)
            b_sg = tl.sigmoid(b_g)
            b_silu = b_g * b_sg
            b_dw += tl.sum(b_da * b_silu * b_u, 1)
            b_daw = b_da * b_w[:, None]
            b_dg = b_daw * b_u * b_sg * (1.0 + b_g * (1.0 - b_sg))
            tl.store(dh + p, b_dg.to(dh.dtype.element_ty), mask=m)
            tl.store(dh + p + I, (b_daw * b_silu).to(dh.dtype.element_ty), mask=m)
        tl.store(dw + b_src, b_dw.to(dw.dtype.element_ty), mask=m_r)


def _swiglu_meta(shape: dict) -> dict:
    return {"BI": min(next_pow2(shape["I"]), 512)}


def _swiglu_runtime(shape: dict) -> dict:
    return {"n_rows": shape["S"]}


def _swiglu_grid(meta: dict) -> tuple[int]:
    return grid_1d(cdiv(meta["n_rows"], meta["BR"]))


_SPEC = {
    "configs": SWIGLU_CONFIGS,
    "meta": _swiglu_meta,
    "runtime": _swiglu_runtime,
    "grid": _swiglu_grid,
    "max_shapes": ({"S": 1 << 24, "I": 4096}, {"S": 131072, "I": 512}),
}
KERNEL_LAUNCHES = {"_moe_swiglu_fwd_kernel": _SPEC, "_moe_swiglu_bwd_kernel": _SPEC}


def swiglu_fwd(h: torch.Tensor, w: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """h [S, 2I] contiguous, w [S] router weights by copy, src [S] int32 -> a [S, I]."""
    S, I = h.shape[0], h.shape[1] // 2
    a = torch.empty(S, I, dtype=h.dtype, device=h.device)
    if S > 0:
        launch(
            _moe_swiglu_fwd_kernel, SWIGLU_CONFIGS, ["I"], _swiglu_grid, h=h, w=w, src=src, a=a, n_rows=S, I=I,
            **_swiglu_meta({"I": I}),
        )  # fmt: skip
    return a


def swiglu_bwd(da, h, w, src) -> tuple[torch.Tensor, torch.Tensor]:
    """da [S, I], h [S, 2I], w [S], src [S] -> dh [S, 2I] in h's dtype, dw [S] in w's dtype."""
    S, I = h.shape[0], h.shape[1] // 2
    dh = torch.empty_like(h)
    dw = torch.empty_like(w)
    if S > 0:
        launch(
            _moe_swiglu_bwd_kernel, SWIGLU_CONFIGS, ["I"], _swiglu_grid, da=da, h=h, w=w, src=src, dh=dh, dw=dw,
            n_rows=S, I=I, **_swiglu_meta({"I": I}),
        )  # fmt: skip
    return dh, dw


@dataclass(frozen=True)
class _NoOptions:
    pass


class MoeSwigluFunction(torch.autograd.Function):
    """(h [S, 2I], w [S], src [S] int32) -> w[src] * silu(gate) * up [S, I]; saves h, w, src."""

    @staticmethod
    def forward(ctx, h, w, src, _opts: _NoOptions):
        ctx.save_for_backward(h, w, src)
        return swiglu_fwd(h, w, src)

    @staticmethod
    def backward(ctx, da):
        h, w, src = ctx.saved_tensors
        dh, dw = swiglu_bwd(da.contiguous(), h, w, src)
        return dh, dw, None, None


def swiglu_triton(h: torch.Tensor, w: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """w[src[s]] * silu(h[s, :I]) * h[s, I:] for h [S, 2I]; w [S] (the router weights of the copies, fp32)
    and src [S] int32 (the copy at each row). Returns [S, I] in h's dtype (autograd-aware)."""
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"h must be [S, 2I], got {tuple(h.shape)}")
    if w.shape != (h.shape[0],) or src.shape != (h.shape[0],):
        raise ValueError(f"w and src must both be [S={h.shape[0]}], got {tuple(w.shape)} and {tuple(src.shape)}")
    return MoeSwigluFunction.apply(h.contiguous(), w.contiguous(), src.contiguous(), _NoOptions())
