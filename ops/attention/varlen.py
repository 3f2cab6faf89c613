"""Causal GQA attention over all packed sequences in one call: flash attention's varlen kernels.

CUDA: torch's bundled FlashAttention-2 through `torch.ops.aten._flash_attention_forward` /
`_flash_attention_backward` with cu_seqlens (the ops under `torch.nn.attention.varlen.varlen_attn`;
called directly because that wrapper's signature changed between torch 2.10 and 2.13, e.g. it gained
`scale` and `enable_gqa`, while the aten schemas used here, with `scale` as a keyword, are the same
in torch 2.5-2.13). GQA is native (k/v keep their HKV heads, no repeat copy); head dims up to 256
(multiples of 8); fp16/bf16 only. The backward's dq accumulation order is fixed only under
`torch.use_deterministic_algorithms(True)` (set by verl's full determinism).

NPU: `torch_npu.npu_fusion_attention` in its "TND" layout with `actual_seq_qlen/kvlen` (cumulative
sequence ends) and the 2048 x 2048 causal mask with sparse_mode 3, as documented by Ascend and used
by transformers' `npu_flash_attn_varlen_func`; its backward is torch_npu's. Written from the
documentation and NOT run on an NPU yet.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..varlen import HostOffsets, host_offsets, host_values, seq_bounds
from .reference import check_attention_inputs

FLASH_DTYPES = (torch.float16, torch.bfloat16)
# Mean packed length from which CUDA runs one SDPA call per sequence instead (cuDNN's attention, what
# SDPA picks on Hopper): at K=256 FlashAttention-2 is slower on long sequences and faster on many short
# ones (docs/ops.md, attention; results/ops_attention.json). The crossover between 1024 and 16384 is not
# measured.
LONG_SEQUENCE = 4096
# The long-sequence SDPA's backend order: cuDNN takes the HKV key/value heads as they are (enable_gqa),
# as fast as on K/V repeated to H heads and with less memory (docs/ops.md, attention;
# benchmarks/attention_memory.py); flash takes GQA too but is slower there; the rest for what both refuse
# (e.g. cuDNN under deterministic mode).
LONG_SEQUENCE_BACKENDS = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]
FLASH_MAX_HEAD_DIM = 256
NPU_MASK_SIZE = 2048  # npu_fusion_attention's compressed causal mask for sparse_mode 3


@dataclass(frozen=True)
class FlashOptions:
    max_len: int  # longest packed sequence
    scale: float
    causal: bool = True


def flash_unavailable() -> str | None:
    """Why torch's flash attention cannot run in this process, or None."""
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return f"torch {torch.__version__} has no aten._flash_attention_forward"
    if not torch.backends.cuda.is_flash_attention_available():
        return f"this torch build ({torch.__version__}) has no flash attention"
    return None


class FlashVarlenFunction(torch.autograd.Function):
    """q [T, H, K], k/v [T, HKV, K], cu_seqlens [N+1] int32 (same device) -> o [T, H, K]."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, opts: FlashOptions):
        n = opts.max_len
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, n, n, 0.0, opts.causal, False, scale=opts.scale
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, seed, offset)
        ctx.opts = opts
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
        n = ctx.opts.max_len
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            do.contiguous(), q, k, v, out, lse, cu, cu, n, n, 0.0, ctx.opts.causal, seed, offset, scale=ctx.opts.scale
        )
        return dq, dk, dv, None, None


def per_sequence_sdpa(
    q, k, v, scale: float, cu_seqlens: torch.Tensor | None, causal: bool, cu_seqlens_cpu: HostOffsets | None = None
) -> torch.Tensor:
    """q [B, T, H, K], k / v [B, T, HKV, K] -> o [B, T, H, K]: one SDPA call per packed sequence
    (per batch of rows without cu_seqlens), the key/value heads shared by their query groups in the
    kernel (enable_gqa) rather than repeated. The long-sequence path of `causal_attention_varlen`."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, K] views
    with sdpa_kernel(LONG_SEQUENCE_BACKENDS, set_priority=True):
        out = [
            F.scaled_dot_product_attention(
                qh[:, :, s:e], kh[:, :, s:e], vh[:, :, s:e], is_causal=causal, scale=scale, enable_gqa=True
            )
            for s, e in seq_bounds(cu_seqlens, q.shape[1], cu_seqlens_cpu)
            if e > s
        ]
    # one sequence: no concatenation copy (SDPA's output is laid out as q, so o is contiguous again)
    return (out[0] if len(out) == 1 else torch.cat(out, dim=2)).transpose(1, 2)


@functools.cache
def _npu_causal_mask(device: torch.device) -> torch.Tensor:
    return torch.ones(NPU_MASK_SIZE, NPU_MASK_SIZE, dtype=torch.bool, device=device).triu(diagonal=1)


def _npu_varlen(q, k, v, ends: list[int], scale: float) -> torch.Tensor:
    import torch_npu

    return torch_npu.npu_fusion_attention(
        q,
        k,
        v,
        q.shape[1],
        "TND",
        atten_mask=_npu_causal_mask(q.device),
        scale=scale,
        keep_prob=1.0,
        actual_seq_qlen=tuple(ends),
        actual_seq_kvlen=tuple(ends),
        sparse_mode=3,
    )[0]


def _packed_offsets(cu_seqlens: torch.Tensor | None, B: int, T: int, cu_seqlens_cpu: HostOffsets | None) -> list[int]:
    """Host offsets of the packed sequences; a [B, T] batch packs as B sequences of T."""
    return list(range(0, B * T + 1, T)) if cu_seqlens is None else host_values(cu_seqlens, cu_seqlens_cpu)


def causal_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    causal: bool = True,
    cu_seqlens_cpu: HostOffsets | None = None,
) -> torch.Tensor:
    """Causal GQA attention, every packed sequence in one kernel call (`causal_attention_ref`'s contract).

    Args:
        q: [B, T, H, K]; k, v: [B, T, HKV, K] (V == K), H a multiple of HKV; fp16/bf16 on CUDA
            (fp16/bf16/fp32 on NPU); K <= 256 and a multiple of 8 on CUDA. Strided inputs are read in
            place when their last dim is contiguous.
        scale: softmax scale, default K ** -0.5.
        cu_seqlens: optional [N+1] int offsets of packed sequences (needs B == 1); without it each
            batch row is one sequence.
        causal: False: every token of a sequence sees the whole sequence (cuda only).
        cu_seqlens_cpu: optional host copy of cu_seqlens (`ops/varlen.py`): the op then reads no offsets back
            from the device.
    Returns:
        o: [B, T, H, K] in q's dtype.
    Raises:
        ValueError: bad shapes/dtypes/cu_seqlens, a dtype or head dim flash attention does not take,
            a device other than cuda/npu, non-causal on npu, or a torch without flash attention.
    """
    cu_seqlens_cpu = host_offsets(cu_seqlens, cu_seqlens_cpu)
    check_attention_inputs(q, k, v, cu_seqlens, cu_seqlens_cpu)
    B, T, H, K = q.shape
    if v.shape[-1] != K:
        raise ValueError(f"varlen attention needs V == K, got V={v.shape[-1]}, K={K}")
    kind = q.device.type
    if kind not in ("cuda", "npu"):
        raise ValueError(f"varlen attention runs on cuda (flash attention) or npu, got {kind}; use impl 'torch'")
    if kind == "npu" and not causal:
        raise ValueError("varlen attention on npu is causal only (sparse_mode 3); use impl 'torch' for causal=False")
    if kind == "cuda":
        if q.dtype not in FLASH_DTYPES:
            raise ValueError(f"flash attention takes float16/bfloat16, got {q.dtype}; use impl 'torch' or 'flex'")
        if K > FLASH_MAX_HEAD_DIM or K % 8:
            raise ValueError(f"flash attention takes head dims <= {FLASH_MAX_HEAD_DIM}, multiples of 8; got K={K}")
        reason = flash_unavailable()
        if reason is not None:
            raise ValueError(f"varlen attention cannot run: {reason}")
    scale = K**-0.5 if scale is None else float(scale)
    if q.numel() == 0:
        return q.clone()  # empty, still attached to the graph
    offsets = _packed_offsets(cu_seqlens, B, T, cu_seqlens_cpu)
    q3, k3, v3 = (t.reshape(B * T, *t.shape[2:]) for t in (q, k, v))
    q3, k3, v3 = (t if t.stride(-1) == 1 else t.contiguous() for t in (q3, k3, v3))
    if kind == "npu":
        return _npu_varlen(q3, k3, v3, offsets[1:], scale).reshape(B, T, H, K)
    max_len = max(b - a for a, b in zip(offsets[:-1], offsets[1:]))
    if offsets[-1] >= LONG_SEQUENCE * (len(offsets) - 1):
        return per_sequence_sdpa(q, k, v, scale, cu_seqlens, causal, cu_seqlens_cpu)
    if cu_seqlens is None:  # built on the device: a host tensor's copy would wait for queued work
        cu = torch.arange(0, B * T + 1, T, dtype=torch.int32, device=q.device)
    else:
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    out = FlashVarlenFunction.apply(q3, k3, v3, cu, FlashOptions(max_len, scale, causal))
    return out.view(B, T, H, K)
