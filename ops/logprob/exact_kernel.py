"""Exact mode's log-softmax normaliser on devices: logsumexp(logits * inv_temperature) of each row by one
program walking the vocabulary in fixed blocks from 0 upwards (online max and sum), so a row's value never
depends on the other rows or the row count (torch's softmax kernels pick their launch by the shape)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.launch import grid_1d, launch

CONFIG = {"BLOCK": 4096, "num_warps": 8}
MAX_SHAPES = ({"N": 1 << 16, "VOCAB": 262144},)


@triton.jit(do_not_specialize=["N"])
def _lse_rows_kernel(logits, inv_t, lse, N, VOCAB, s_n, BLOCK: tl.constexpr):
    """lse[n] = log sum_v exp(logits[n, v] * inv_t[n]) for fp32 logits [N, VOCAB] (row stride s_n)."""
    i_p, n_p = tl.program_id(0), tl.num_programs(0)
    o_v = tl.arange(0, BLOCK)
    for i_n in range(i_p, N, n_p):
        b_inv = tl.load(inv_t + i_n)
        b_m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        b_s = tl.zeros([BLOCK], dtype=tl.float32)
        for v0 in range(0, VOCAB, BLOCK):
            m_v = (v0 + o_v) < VOCAB
            b_x = tl.load(logits + tl.cast(i_n, tl.int64) * s_n + v0 + o_v, mask=m_v, other=0.0) * b_inv
            b_x = tl.where(m_v, b_x, float("-inf"))
            b_m_new = tl.maximum(b_m, b_x)
            # lanes that have seen nothing yet keep exp(-inf - -inf) out of the sum
            b_s = tl.where(b_m_new == float("-inf"), 0.0, b_s * tl.exp(b_m - b_m_new) + tl.exp(b_x - b_m_new))
            b_m = b_m_new
        b_max = tl.max(b_m, 0)
        b_total = tl.sum(tl.where(b_m == float("-inf"), 0.0, b_s * tl.exp(b_m - b_max)), 0)
        tl.store(lse + i_n, b_max + tl.log(b_total))


KERNEL_LAUNCHES = {
    "_lse_rows_kernel": {
        "configs": [CONFIG],
        "meta": lambda shape: {},
        "grid": lambda meta: grid_1d(meta["N"]),
        "runtime": lambda shape: {},
        "max_shapes": MAX_SHAPES,
    },
}


def scaled_logsumexp_triton(logits: torch.Tensor, inv_temperature: torch.Tensor) -> torch.Tensor:
    """logits [N, VOCAB] fp32 (unit last stride), inv_temperature [N] -> [N] fp32 logsumexp of the scaled rows."""
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"exact logsumexp takes fp32 logits with a unit last stride, got {logits.dtype}")
    N, VOCAB = logits.shape
    lse = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N:
        launch(
            _lse_rows_kernel,
            [CONFIG],
            ["VOCAB"],
            lambda meta: grid_1d(N),
            logits=logits,
            inv_t=inv_temperature.float().contiguous(),
            lse=lse,
            N=N,
            VOCAB=VOCAB,
            s_n=logits.stride(0),
        )
    return lse


__all__ = ["scaled_logsumexp_triton"]
