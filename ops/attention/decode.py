"""One-token attention over each row's cached keys and values, for decoding.

Row b's query (H heads) attends to positions [0, counts[b]) of its slot's cache (HKV heads, query head h
reading kv head h // (H / HKV)). The caches have a fixed capacity L, so a decode step keeps one shape
whatever the lengths.

The op resolves as `resolve("attention.decode")` (IMPLS below): `decode_attention_ref` (SDPA over the
whole capacity with a mask; on CUDA its memory-efficient kernel, faster than cuDNN's at decode shapes:
docs/ops.md, the ops table) or `decode_kernel.decode_attention_triton` (split by tiles
of positions, each row reading only its visible tiles: the read no longer grows with the capacity), the
accelerator default.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

IMPLS = {
    "torch": "verl_moe.ops.attention.decode:decode_attention_ref",
    "triton": "verl_moe.ops.attention.decode_kernel:decode_attention_triton",
    "exact": "verl_moe.ops.attention.exact:decode_attention_exact",
}
ACCELERATOR_DEFAULT = "triton"


def check_decode_attention_inputs(q, k_cache, v_cache, counts, slots=None) -> None:
    """Raise ValueError for shapes or dtypes the op cannot take (no value is read); `slots`: the cache row
    of each query row (the Triton kernel's option), else row b reads row b."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"q must be [B, H, D] and k_cache / v_cache one [S, HKV, L, D] shape; got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    B, H, D = q.shape
    S, HKV, _, DK = k_cache.shape
    if (slots is None and S < B) or DK != D or H % HKV:
        raise ValueError(
            f"q [B={B}, H={H}, D={D}] does not fit caches [S={S}, HKV={HKV}, L, D={DK}] (S >= B, H a multiple of HKV)"
        )
    if slots is not None and (slots.dtype != torch.int64 or tuple(slots.shape) != (B,)):
        raise ValueError(f"slots must be a [{B}] int64 tensor, got {tuple(slots.shape)} {slots.dtype}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype) or not q.is_floating_point():
        raise ValueError(f"q and the caches must share one floating dtype, got {q.dtype}, {k_cache.dtype}")
    if counts.dtype != torch.int64 or tuple(counts.shape) != (B,):
        raise ValueError(f"counts must be a [{B}] int64 tensor, got {tuple(counts.shape)} {counts.dtype}")


def _sdpa_backends(device: torch.device):
    """On CUDA the memory-efficient kernel first (torch's own pick with a mask is cuDNN's, slower here);
    elsewhere torch's choice."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    order = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(order, set_priority=True)


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    counts: torch.Tensor,
    scale: float,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v per row over positions [0, counts[b]) of cache row b.

    Args:
        q: [B, H, D]. k_cache, v_cache: [S, HKV, L, D] with S >= B (rows [0, B) are read), q's dtype.
        counts: [B] int64 in [1, L]: how many positions each row sees.
        scale: the softmax scale.
        slots: [B] int64, the cache row each query row reads (several rows may read one: a slot's
            positions verified at once); default row b reads row b.
    Returns:
        [B, H, D] in q's dtype (SDPA's math in that dtype).
    Raises:
        ValueError: shapes or dtypes that do not fit.
    """
    check_decode_attention_inputs(q, k_cache, v_cache, counts, slots)
    B, H, D = q.shape
    HKV, L = k_cache.shape[1], k_cache.shape[2]
    # the group's query heads act as SDPA query rows of their kv head
    qg = q.reshape(B, HKV, H // HKV, D)
    visible = torch.arange(L, device=q.device)[None, :] < counts[:, None]
    with _sdpa_backends(q.device):
        o = F.scaled_dot_product_attention(
            qg,
            k_cache[:B] if slots is None else k_cache[slots],
            v_cache[:B] if slots is None else v_cache[slots],
            attn_mask=visible[:, None, None, :],
            scale=scale,
        )  # [B, HKV, group, D]
    return o.reshape(B, H, D)


__all__ = ["IMPLS", "check_decode_attention_inputs", "decode_attention_ref"]
