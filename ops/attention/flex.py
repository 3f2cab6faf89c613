"""Causal GQA attention over all packed sequences in one FlexAttention call with a document mask.

A key is visible to a query when both sit in the same packed sequence and the key is not later.
FlexAttention skips the fully masked blocks and takes GQA natively (`enable_gqa`: no k/v repeat).
On cuda it runs torch.compile'd (the fused Triton kernels; the first call of each shape compiles,
a second shape compiles once more with dynamic shapes); on CPU it runs eagerly, forward only
(torch has no CPU backward for it), which is what the CPU tests use. Any float dtype.
The block mask is built once per packed layout, keyed by the offsets' host values (every layer of a
step shares it).
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from ..varlen import HostOffsets, host_offsets, host_values
from .reference import check_attention_inputs


@functools.cache
def _compiled(fn):
    return torch.compile(fn)


def _make_block_mask(doc: torch.Tensor, causal: bool = True):
    """Block mask of (causal) attention within the sequences `doc` [T] (sequence index per token) marks."""

    def same_sequence_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    def same_sequence(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    T = doc.numel()
    # compiled on accelerators: eagerly, the mask is first materialised as [T, T] (gigabytes at 32K tokens)
    make = create_block_mask if doc.device.type == "cpu" else _compiled(create_block_mask)
    return make(same_sequence_causal if causal else same_sequence, None, None, T, T, device=doc.device)


@functools.lru_cache(maxsize=8)
def _block_mask(offsets: tuple[int, ...] | None, T: int, device: torch.device, causal: bool = True):
    """The block mask of packed sequences at host `offsets` (None: one sequence of T tokens)."""
    if offsets is None:
        return _make_block_mask(torch.zeros(T, dtype=torch.int32, device=device), causal)
    lengths = torch.tensor([e - s for s, e in zip(offsets[:-1], offsets[1:])])
    ids = torch.repeat_interleave(torch.arange(lengths.numel(), dtype=torch.int32), lengths, output_size=T)
    return _make_block_mask(ids.to(device), causal)


def causal_attention_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    causal: bool = True,
    cu_seqlens_cpu: HostOffsets | None = None,
) -> torch.Tensor:
    """Causal GQA attention through FlexAttention (`causal_attention_ref`'s contract).

    Args:
        q: [B, T, H, K]; k: [B, T, HKV, K]; v: [B, T, HKV, V], H a multiple of HKV; any float dtype.
        scale: softmax scale, default K ** -0.5.
        cu_seqlens: optional [N+1] int offsets of packed sequences (needs B == 1).
        causal: False: every token of a sequence sees the whole sequence.
        cu_seqlens_cpu: optional host copy of cu_seqlens (`ops/varlen.py`): the op then reads no offsets back
            from the device.
    Returns:
        o: [B, T, H, V] in q's dtype.
    Raises:
        ValueError: bad shapes/dtypes/cu_seqlens, or inputs that need a gradient on CPU.
    """
    cu_seqlens_cpu = host_offsets(cu_seqlens, cu_seqlens_cpu)
    check_attention_inputs(q, k, v, cu_seqlens, cu_seqlens_cpu)
    T, H = q.shape[1], q.shape[2]
    on_cpu = q.device.type == "cpu"
    if on_cpu and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError("flex attention has no CPU backward in torch: use impl 'torch' for training on CPU")
    if q.numel() == 0:
        return q.new_empty(*q.shape[:3], v.shape[-1])
    offsets = None if cu_seqlens is None else tuple(host_values(cu_seqlens, cu_seqlens_cpu))
    mask = _block_mask(offsets, T, q.device, causal)
    args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    options = {"block_mask": mask, "scale": scale, "enable_gqa": H != k.shape[2]}
    if not on_cpu:
        return _compiled(flex_attention)(*args, **options).transpose(1, 2)
    with warnings.catch_warnings():  # the eager (unfused) path is the point on CPU
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(*args, **options).transpose(1, 2)
