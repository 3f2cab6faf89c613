"""Exact mode's attention: one per-row arithmetic for the trainer's packed forward, the prefill and the
decode step, in PyTorch here (the CPU form) and in one Triton kernel on devices (`exact_kernel.py`).

`attention_rows`: query row r attends to positions start[r] + [0, count[r]) of its slot of a cache
[S, HKV, L, K]. The positions are visited in tiles of TILE counted from the row's own start, with an
online softmax (running max, sum and output, rescaled per tile) in the same order for every row, and
every reduction has a fixed size (K for a score, TILE for a tile's sum): a row's output depends on its
query and its visible keys and values alone, not on the capacity L, the other rows, nor whether the keys
come from the packed row of a training batch or from a decode slot. Rows skip the tiles they cannot see.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..dispatch import resolve
from ..exact import by_device, exact_forward
from ..varlen import HostOffsets, sequence_starts
from .cached import chunk_rows
from .exact_kernel import attention_rows_triton
from .reference import causal_attention_ref, check_attention_inputs

TILE = 16  # positions per online-softmax tile


def attention_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: torch.Tensor,
    start: torch.Tensor,
    count: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [R, H, K]; k_cache [S, HKV, L, K], v_cache [S, HKV, L, V]; slot, start, count: [R] int64 with
    count >= 1 and start + count <= L. Returns [R, H, V] in q's dtype (math in fp32, fp64 for fp64)."""
    R, H, K = q.shape
    HKV, L = k_cache.shape[1], k_cache.shape[2]
    G, V = H // HKV, v_cache.shape[-1]
    cd = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(cd).reshape(R, HKV, G, 1, K)
    m = torch.full((R, HKV, G), float("-inf"), dtype=cd, device=q.device)
    s_sum = torch.zeros(R, HKV, G, dtype=cd, device=q.device)
    acc = torch.zeros(R, HKV, G, V, dtype=cd, device=q.device)
    offsets = torch.arange(TILE, device=q.device)
    tiles = -(-int(count.max()) // TILE) if R else 0
    for j in range(tiles):
        pos = j * TILE + offsets
        visible = pos[None, :] < count[:, None]  # [R, TILE]
        index = (start[:, None] + pos[None, :]).clamp(max=L - 1)
        k_tile = k_cache[slot[:, None], :, index].to(cd).permute(0, 2, 1, 3)[:, :, None]  # [R, HKV, 1, TILE, K]
        v_tile = v_cache[slot[:, None], :, index].to(cd).permute(0, 2, 1, 3)[:, :, None]  # [R, HKV, 1, TILE, V]
        scores = (qg * k_tile).sum(-1) * scale  # [R, HKV, G, TILE]
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, scores.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(scores - m_new[..., None])
        s_new = s_sum * alpha + p.sum(-1)
        acc_new = acc * alpha[..., None] + (p[..., None] * v_tile).sum(-2)
        seen = visible[:, 0, None, None]  # the row sees this tile at all (else it keeps its state exactly)
        m, s_sum = torch.where(seen, m_new, m), torch.where(seen, s_new, s_sum)
        acc = torch.where(seen[..., None], acc_new, acc)
    return (acc / s_sum[..., None]).reshape(R, H, V).to(q.dtype)


# `attention_rows` on the device of its arguments
rows_on_device = by_device(attention_rows, attention_rows_triton)


def _packed_attention_rows(
    q, k, v, scale=None, cu_seqlens=None, causal: bool = True, cu_seqlens_cpu: HostOffsets | None = None
) -> torch.Tensor:
    """`causal_attention_ref`'s contract by `attention_rows`: token t of a sequence starting at s sees
    [s, t] of its own sequence."""
    check_attention_inputs(q, k, v, cu_seqlens, cu_seqlens_cpu)
    if not causal:
        raise ValueError(
            "exact attention is causal only (the vision tower's bidirectional attention has no exact form)"
        )
    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    start = sequence_starts(B, T, cu_seqlens, cu_seqlens_cpu, q.device)
    token = torch.arange(B * T, device=q.device)
    k_cache = k.reshape(1, B * T, *k.shape[2:]).transpose(1, 2)  # all B rows as one slot [1, HKV, B*T, K]
    v_cache = v.reshape(1, B * T, *v.shape[2:]).transpose(1, 2)
    slot = torch.zeros_like(token)
    o = rows_on_device(q.reshape(B * T, H, K), k_cache, v_cache, slot, start, token - start + 1, scale)
    return o.reshape(B, T, H, -1)


def _fast_on_device(q, k, v, scale=None, cu_seqlens=None, causal: bool = True, cu_seqlens_cpu=None):
    """The device's attention for the gradient: its default (flash attention on cuda) for 16-bit inputs,
    the reference for fp32 ones (flash attention takes 16-bit inputs only)."""
    fast = resolve("attention", "torch" if q.dtype == torch.float32 else None)
    return fast(q, k, v, scale=scale, cu_seqlens=cu_seqlens, causal=causal, cu_seqlens_cpu=cu_seqlens_cpu)


# the dispatched "exact" attention: the per-row form forward, the fast form's gradient
causal_attention_exact = exact_forward(_packed_attention_rows, by_device(causal_attention_ref, _fast_on_device))


def decode_attention_exact(q, k_cache, v_cache, counts, scale, slots=None):
    """`attention.decode`'s contract by `attention_rows` (row b reads slot b, or slots[b], from position 0)."""
    rows = torch.arange(q.shape[0], device=q.device) if slots is None else slots
    return rows_on_device(q, k_cache, v_cache, rows, torch.zeros_like(rows), counts, scale)


def cached_attention_exact(
    q, k_cache, v_cache, slots: Sequence[int], starts: Sequence[int], cu_cpu: Sequence[int], scale: float
):
    """`attention.cached`'s contract by `attention_rows`."""
    slot, pos = chunk_rows(slots, starts, cu_cpu, q.device)
    return rows_on_device(q, k_cache, v_cache, slot, torch.zeros_like(slot), pos + 1, scale)


__all__ = ["TILE", "attention_rows", "cached_attention_exact", "causal_attention_exact", "decode_attention_exact"]
