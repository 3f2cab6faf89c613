"""Causal grouped-query attention over packed sequences (Qwen3.5 / Qwen3-MoE full-attention layers).

The dispatched `attention` callable is `causal_attention_ref`'s contract; `causal=False` (the vision
tower's attention over each image's patches) drops the causal mask inside each packed sequence.
`decode.py` holds the decoding op, one token per row over fixed-capacity caches (`attention.decode`),
`cached.py` the prefill of prompt chunks that continue their slots (`attention.cached`), `exact.py` exact
mode's one per-row arithmetic behind all three.
"""

from .. import device
from ..dispatch import resolve
from .reference import causal_attention_ref

IMPLS = {
    "torch": "verl_moe.ops.attention.reference:causal_attention_ref",
    "varlen": "verl_moe.ops.attention.varlen:causal_attention_varlen",
    "flex": "verl_moe.ops.attention.flex:causal_attention_flex",
    "exact": "verl_moe.ops.attention.exact:causal_attention_exact",
}
# cuda: flash attention's varlen kernel, all packed sequences in one call (fp16/bf16; an fp32 model on
# cuda needs attention "torch" or "flex"). npu keeps the per-sequence reference until the
# npu_fusion_attention path of "varlen" has run on an NPU.
ACCELERATOR_DEFAULT = "varlen" if device.device_type() == "cuda" else "torch"


def causal_attention(
    q, k, v, scale=None, cu_seqlens=None, causal: bool = True, cu_seqlens_cpu=None, impl: str | None = None
):
    """Causal attention (bidirectional within each sequence with causal=False) through the
    implementation `resolve("attention", impl)` picks; arguments and returns as `causal_attention_ref`."""
    return resolve("attention", impl)(
        q, k, v, scale=scale, cu_seqlens=cu_seqlens, causal=causal, cu_seqlens_cpu=cu_seqlens_cpu
    )


__all__ = ["ACCELERATOR_DEFAULT", "IMPLS", "causal_attention", "causal_attention_ref"]
