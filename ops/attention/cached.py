"""Attention of prompt chunks that continue their decode slots (a long prompt prefilled in chunks): chunk
n's rows are its tokens, at positions starts[n], starts[n] + 1, ... of slot slots[n], and each attends to
its slot's cached keys up to and including its own position (the chunk's keys and values are in the
cache already).

The op resolves as `resolve("attention.cached")`: "torch" (one SDPA per chunk, the grouped heads as
query rows), "triton" (the accelerator default: short chunks as rows of one Triton decode-attention launch,
long ones as "torch") or "exact" (`exact.attention_rows`, exact mode).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..device import to_device

IMPLS = {
    "torch": "verl_moe.ops.attention.cached:cached_attention_ref",
    "triton": "verl_moe.ops.attention.cached:cached_attention_triton",
    "exact": "verl_moe.ops.attention.exact:cached_attention_exact",
}
# the longest chunk taken as decode rows: each row reads its slot's keys alone, so a chunk of n rows reads
# them n times, against one flash call per chunk (a launch or more per chunk and slot)
SHORT_CHUNK = 16


def cached_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: Sequence[int],
    starts: Sequence[int],
    cu_cpu: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """q [T, H, K] (the chunks' rows, chunk n = rows cu_cpu[n]:cu_cpu[n+1]); k_cache [S, HKV, L, K],
    v_cache [S, HKV, L, V]; slots / starts: per chunk; returns [T, H, V] in q's dtype."""
    T, H, K = q.shape
    HKV = k_cache.shape[1]
    group = H // HKV
    outs = []
    for n, (slot, start) in enumerate(zip(slots, starts)):
        a, b = cu_cpu[n], cu_cpu[n + 1]
        end = start + b - a
        qg = q[a:b].transpose(0, 1).reshape(HKV, group * (b - a), K)  # rows: (head in group, token)
        query_pos = start + torch.arange(b - a, device=q.device).repeat(group)
        visible = torch.arange(end, device=q.device)[None, :] <= query_pos[:, None]
        o = F.scaled_dot_product_attention(
            qg, k_cache[slot, :, :end], v_cache[slot, :, :end], attn_mask=visible, scale=scale
        )  # [HKV, group * T_n, V]
        outs.append(o.reshape(H, b - a, -1).transpose(0, 1))
    return torch.cat(outs)


def cached_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: Sequence[int],
    starts: Sequence[int],
    cu_cpu: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """`cached_attention_ref`'s contract. Chunks of at most SHORT_CHUNK rows (the MTP layer's catch-up in
    speculative decoding: a few rows in each of many slots) run as the rows of one Triton decode-attention
    launch, each row a query at its own position that reads its slot's first position + 1 keys; a batch with
    a longer chunk (a long prompt prefilled in pieces) takes `cached_attention_ref`."""
    if max(b - a for a, b in zip(cu_cpu[:-1], cu_cpu[1:])) > SHORT_CHUNK or q.dtype == torch.float64:
        return cached_attention_ref(q, k_cache, v_cache, slots, starts, cu_cpu, scale)
    from .decode_kernel import decode_attention_triton

    slot, pos = chunk_rows(slots, starts, cu_cpu, q.device)
    return decode_attention_triton(q, k_cache, v_cache, pos + 1, scale, slots=slot)


def chunk_rows(slots, starts, cu_cpu, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of the chunks: (its slot, its position in the slot) as [T] int64 on `device`, one copy there."""
    lengths = [b - a for a, b in zip(cu_cpu[:-1], cu_cpu[1:])]
    slot = [s for s, n in zip(slots, lengths) for _ in range(n)]
    pos = [start + i for start, n in zip(starts, lengths) for i in range(n)]
    slot, pos = to_device(torch.tensor([slot, pos], dtype=torch.long), device)
    return slot, pos


__all__ = ["IMPLS", "SHORT_CHUNK", "cached_attention_ref", "cached_attention_triton", "chunk_rows"]
