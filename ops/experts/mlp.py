"""The routed expert MLP as one autograd Function over the Triton token moves and F.grouped_mm, saving
only the gate_up output. At decode sizes (few rows per expert) the forward's two GEMMs run our Triton
grouped GEMM instead (`_forward_gemm`).

Forward, for the S = N * TOPK copies in expert-sorted order (`permute.moe_sort`):
    x = scatter_rows(hidden) [S, D] -> h = grouped_mm(x, gate_up^T) [S, 2I]
    -> a = w * silu(gate) * up [S, I] -> y = grouped_mm(a, down^T) [S, D] -> out = gather_sum(y) [N, D]
Saved: h (16-bit), the int32 routing and the fp32 weights [S]; the permuted rows x and the activation
a are recomputed in backward (one [S, D] scatter and one elementwise pass) rather than kept: with
autograd over the separate steps a layer keeps x, h and a, here h alone (at 8192 tokens, 256 experts
top-8, D 2048, I 512 in bf16: 128 MiB per layer instead of 448 MiB).
Backward: dy = scatter_rows(dout); da = grouped_mm(dy, down); d down = grouped_mm(dy^T, a);
dh, dw = the SwiGLU backward; dx = grouped_mm(dh, gate_up) -> d hidden = gather_sum(dx);
d gate_up = grouped_mm(dh^T, x). The weight gradients are grouped GEMMs over the token dim (2-D x 2-D
with offs), as torch's own grouped_mm backward computes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .grouped_gemm import SMALL_ROWS_CONFIGS, SMALL_ROWS_PER_EXPERT, grouped_gemm_rows
from .permute import gather_sum, scatter_rows
from .reference import Routing
from .swiglu import swiglu_bwd, swiglu_fwd


@dataclass(frozen=True)
class _MlpOptions:
    top_k: int
    rows_configs: tuple[dict, ...] | None = None  # pinned row-GEMM configs for the forward (exact mode)


def _forward_gemm(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, opts: _MlpOptions) -> torch.Tensor:
    """x [S, IN] @ weight[e].T for each expert's rows: our Triton grouped GEMM in `opts.rows_configs` when
    pinned; else F.grouped_mm, or on an accelerator at decode sizes (<= SMALL_ROWS_PER_EXPERT rows per
    expert) the Triton grouped GEMM with its pinned small-rows config."""
    if opts.rows_configs is not None:
        return grouped_gemm_rows(x, weight.transpose(-2, -1), ends, list(opts.rows_configs))
    if x.device.type != "cpu" and x.shape[0] <= SMALL_ROWS_PER_EXPERT * weight.shape[0]:
        return grouped_gemm_rows(x, weight.transpose(-2, -1), ends, SMALL_ROWS_CONFIGS)
    return F.grouped_mm(x, weight.transpose(-2, -1), offs=ends)


class MoeExpertsMlpFunction(torch.autograd.Function):
    """(hidden [N, D], gate_up_proj [E, 2I, D], down_proj [E, D, I], w [S] fp32 router weights by copy,
    dest / src / ends int32 routing) -> [N, D] in hidden's dtype."""

    @staticmethod
    def forward(ctx, hidden, gate_up, down, w, dest, src, ends, opts: _MlpOptions):
        x = scatter_rows(hidden, dest, opts.top_k)
        h = _forward_gemm(x, gate_up, ends, opts)
        del x
        y = _forward_gemm(swiglu_fwd(h, w, src), down, ends, opts)
        ctx.save_for_backward(hidden, gate_up, down, w, dest, src, ends, h)
        ctx.opts = opts
        return gather_sum(y, dest, opts.top_k)

    @staticmethod
    def backward(ctx, dout):
        hidden, gate_up, down, w, dest, src, ends, h = ctx.saved_tensors
        top_k = ctx.opts.top_k
        dy = scatter_rows(dout.contiguous(), dest, top_k)  # [S, D]
        da = F.grouped_mm(dy, down, offs=ends)  # [S, I]
        ddown = F.grouped_mm(dy.t(), swiglu_fwd(h, w, src), offs=ends) if ctx.needs_input_grad[2] else None
        del dy
        dh, dw = swiglu_bwd(da, h, w, src)
        del da
        dhidden = gather_sum(F.grouped_mm(dh, gate_up, offs=ends), dest, top_k) if ctx.needs_input_grad[0] else None
        dgate_up = None
        if ctx.needs_input_grad[1]:
            dgate_up = F.grouped_mm(dh.t(), scatter_rows(hidden, dest, top_k), offs=ends)
        return dhidden, dgate_up, ddown, dw, None, None, None, None


def experts_mlp(
    hidden, gate_up_proj, down_proj, w, routing: Routing, top_k: int, rows_configs: tuple[dict, ...] | None = None
) -> torch.Tensor:
    """hidden [N, D], gate_up_proj [E, 2I, D], down_proj [E, D, I] in one dtype that F.grouped_mm takes,
    w [S] fp32 router weights by copy, `routing` of the S = N * TOPK copies -> [N, D]. rows_configs: run
    the forward's GEMMs in these row-GEMM configs whatever the size (a row's result is then its own)."""
    return MoeExpertsMlpFunction.apply(
        hidden.contiguous(), gate_up_proj.contiguous(), down_proj.contiguous(), w.contiguous(), routing.dest,
        routing.src, routing.ends, _MlpOptions(top_k, rows_configs),
    )  # fmt: skip
