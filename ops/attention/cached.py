"""Attention of prompt chunks that continue their decode slots (a long prompt prefilled in chunks): chunk
n's rows are its tokens, at positions starts[n], starts[n] + 1, ... of slot slots[n], and each attends to
its slot's cached keys up to and including its own position (the chunk's keys and values are in the
cache already).

The op resolves as `resolve("attention.cached")`: "torch" (one SDPA per chunk, the grouped heads as
query rows) or "exact" (`exact.attention_rows`, exact mode).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

IMPLS = {
    "torch": "verl_moe.ops.attention.cached:cached_attention_ref",
    "exact": "verl_moe.ops.attention.exact:cached_attention_exact",
}


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


__all__ = ["IMPLS", "cached_attention_ref"]
