"""Routed experts as two grouped GEMMs over expert-sorted token copies (no per-expert launches, no
atomics: deterministic).

    sort the N * TOPK copies by expert -> permute token rows to that order -> grouped GEMM gate_up
    -> w * silu(gate) * up (the router weight applied here) -> grouped GEMM down
    -> each token's TOPK rows summed (fp32)

Two sets of token moves run this pipeline: the Triton ones (counting sort, row scatter/gather-sum and
the weighted SwiGLU as Triton kernels, `permute.py` / `swiglu.py`) and `TORCH_MOVES` (argsort and
indexing, `reference.py`), as the "triton" and "grouped" implementations. The grouped GEMM is
`torch.nn.functional.grouped_mm` (CUDA sm80+, CPU) where it takes the dtype and strides; else our
Triton grouped GEMM (`grouped_gemm.py`: NPU, unaligned rows on CUDA, the interpreter); else (fp64,
plain CPU) a loop over the expert segments. With the Triton moves and
grouped_mm the whole MLP is one autograd Function that saves only the gate_up output (`mlp.py`).

Numerics: the combine weights multiply silu(gate) * up in fp32 (before the down projection, which is
linear) and each token's TOPK outputs are summed in fp32; outputs in hidden's dtype. For fp32 inputs
every step is fp32, as `moe_experts_ref`; for bf16 the down input w * a is rounded once to bf16 where
the reference rounds a (the same error size).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .reference import check_experts_inputs, empty_experts, permute_ref, sort_ref, swiglu_ref, unpermute_ref


def grouped_mm_takes(like: torch.Tensor, *dims: int) -> bool:
    """Whether F.grouped_mm runs for operands of `like`'s dtype and device whose rows have these sizes."""
    if not hasattr(F, "grouped_mm") or like.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if like.device.type not in ("cuda", "cpu"):  # torch_npu has no grouped_mm kernel: segment loop there
        return False
    # On CUDA only bf16 has a native grouped_mm kernel; other dtypes take torch's per-group fallback,
    # which copies the offsets to the host (a sync per call, and impossible inside a graph capture).
    if like.device.type == "cuda" and like.dtype != torch.bfloat16:
        return False
    # grouped_mm needs 16-byte aligned strides on every operand.
    return all((d * like.element_size()) % 16 == 0 for d in dims)


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    return grouped_mm_takes(x, x.shape[-1], w.shape[-1], w.shape[-2])


def _triton_grouped_gemm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether our Triton grouped GEMM takes these operands: 16/32-bit floats on an accelerator (or
    under TRITON_INTERPRET=1), at most its expert limit. fp64 and plain CPU keep the segment loop."""
    from ..common.launch import interpreting

    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or w.shape[0] > 1024:
        return False
    return x.device.type != "cpu" or interpreting()


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x: [S, IN] rows sorted by group; weight: [E, OUT, IN]; offsets: [E] int32 cumulative row ends.
    Returns [S, OUT]: row s of group e is x[s] @ weight[e].T."""
    w_t = weight.contiguous().transpose(-2, -1)  # [E, IN, OUT]; grouped_mm takes this (column-major) layout
    if x.shape[0] == 0:  # no rows: keep the graph to the weight (a zero gradient)
        return x @ w_t[0] + 0 * weight.sum()
    if _grouped_mm_ok(x, weight):
        return F.grouped_mm(x, w_t, offs=offsets)
    if _triton_grouped_gemm_ok(x, weight):  # NPU, unaligned rows on cuda, the interpreter
        from .grouped_gemm import grouped_gemm

        return grouped_gemm(x, weight, offsets)
    ends = offsets.tolist()
    starts = [0] + ends[:-1]
    return torch.cat([x[s:e] @ w_t[g] for g, (s, e) in enumerate(zip(starts, ends))], dim=0)


@dataclass(frozen=True)
class TokenMoves:
    """The token-movement steps of the grouped pipeline (contracts of `reference.py`'s sort_ref,
    permute_ref, swiglu_ref, unpermute_ref)."""

    name: str
    sort: Callable
    permute: Callable
    swiglu: Callable
    unpermute: Callable


TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TORCH_MOVES = TokenMoves("torch", sort_ref, permute_ref, swiglu_ref, unpermute_ref)


def _triton_moves() -> TokenMoves:
    from .permute import moe_sort, permute_triton, unpermute_triton
    from .swiglu import swiglu_triton

    return TokenMoves("triton", moe_sort, permute_triton, swiglu_triton, unpermute_triton)


def grouped_experts(hidden, gate_up_proj, down_proj, topk_idx, topk_weight, moves: TokenMoves) -> torch.Tensor:
    """The grouped pipeline with `moves` (inputs checked by the caller); `moe_experts_ref`'s contract."""
    N, TOPK = topk_idx.shape
    if N == 0:
        return empty_experts(hidden, gate_up_proj, down_proj, topk_weight)
    E, I = gate_up_proj.shape[0], down_proj.shape[2]
    routing = moves.sort(topk_idx.reshape(-1), E)
    w = topk_weight.reshape(-1)
    if w.dtype != torch.float64:
        w = w.float()  # the combine weights stay in (at least) fp32
    if moves.name == "triton" and grouped_mm_takes(hidden, hidden.shape[1], 2 * I, I):
        from .mlp import experts_mlp  # one Function that saves only the gate_up output

        return experts_mlp(hidden, gate_up_proj, down_proj, w, routing, TOPK)
    x = moves.permute(hidden, routing, TOPK)  # [S, D], grouped by expert
    h = grouped_linear(x, gate_up_proj, routing.ends)  # [S, 2I]
    a = moves.swiglu(h, w, routing.src)  # [S, I] = w * silu(gate) * up
    y = grouped_linear(a, down_proj, routing.ends)  # [S, D]
    return moves.unpermute(y, routing, TOPK)


@dataclass(frozen=True)
class GroupedExperts:
    """A dispatched `experts` implementation: the grouped pipeline with one set of token moves.
    `moves` is what the expert-parallel op uses for its own sort and permutations."""

    moves_name: str

    @property
    def moves(self) -> TokenMoves:
        return TORCH_MOVES if self.moves_name == "torch" else _triton_moves()

    def __call__(
        self,
        hidden: torch.Tensor,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weight: torch.Tensor,
    ) -> torch.Tensor:
        """Same contract as `moe_experts_ref`: hidden [N, D] (N may be 0), gate_up_proj [E, 2I, D],
        down_proj [E, D, I], topk_idx / topk_weight [N, TOPK] -> [N, D] in hidden's dtype. Raises
        ValueError as `check_experts_inputs`, and for fp64 with the Triton moves (fp32 math)."""
        check_experts_inputs(hidden, gate_up_proj, down_proj, topk_idx, topk_weight)
        if self.moves_name == "triton" and hidden.dtype not in TRITON_DTYPES:
            raise ValueError(f"the Triton experts take fp32/bf16/fp16 activations, got {hidden.dtype} (use 'grouped')")
        return grouped_experts(hidden, gate_up_proj, down_proj, topk_idx, topk_weight, self.moves)


moe_experts_grouped = GroupedExperts("torch")
moe_experts_triton = GroupedExperts("triton")


def token_moves_for(experts: Callable) -> TokenMoves:
    """The token moves that go with a dispatched experts callable (torch ones for `moe_experts_ref`)."""
    return experts.moves if isinstance(experts, GroupedExperts) else TORCH_MOVES
