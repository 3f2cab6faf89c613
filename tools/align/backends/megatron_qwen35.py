"""Qwen3.5-MoE in megatron-core without TransformerEngine: the parts `megatron.py` adds for it.

megatron-core's `GatedDeltaNet` (`megatron/core/ssm/gated_delta_net.py`) is built by its hybrid
spec only for TransformerEngine (its `in_proj` is `column_parallel_layer_norm_linear()`, which the
local spec provider has not). The smallest composition without TE (`decoder_block_spec`): the local
GPT layer specs of `get_gpt_decoder_block_spec` (attention + MoE + shared expert), and on the
`linear_attention` layers of `layer_types` the attention replaced by `GatedDeltaNet` with
`in_proj` = `ColumnParallelLinear` after the layer's own `input_layernorm` (the TE spec fuses
that norm into in_proj; the math is the same), `out_norm` = the local RMSNorm (plain weight, as
HF's gated norm), `out_proj` = `RowParallelLinear`.

The (1 + w) RMSNorms (decoder, final, q/k norms): megatron's `layernorm_zero_centered_gamma`
exists only in TE's and apex's norms; the local `WrappedTorchNorm` refuses it. `UnitOffsetRMSNorm`
is that norm (megatron's convention: weight + 1, computed in fp32 like HF) with the same
constructor, so HF weights load unchanged (no w - 1 rounding).

RoPE: the align stream is text, so the three mRoPE position rows are equal and HF's interleaved
mRoPE equals plain partial RoPE (first `partial_rotary_factor` of each head, rotate-half): the
model uses megatron's `rope` with `rotary_percent`. megatron's own `mrope`
(`MultimodalRotaryEmbedding`) takes contiguous sections [t.. h.. w..] (Qwen2-VL), not Qwen3.5's
interleaved t h w t h w ... (equal on text positions; tests/tools/test_align_megatron_qwen35.py
measures it on image-like positions).

The HF <-> megatron names and layouts of these parts are in `megatron_names.py`.
"""

from __future__ import annotations

import copy

import torch


def fla_backward_refused() -> str | None:
    """Why fla's gated delta rule cannot train here, or None. fla 0.6 raises in its backward on
    Hopper with Triton in [3.4, 3.7.1): a Triton miscompile of `chunk_bwd_dqkwg` (fla issue #640,
    wrong db / dg)."""
    try:
        from fla import utils
    except ImportError:
        return None
    if getattr(utils, "IS_NVIDIA_HOPPER", False) and utils.TRITON_ABOVE_3_4_0 and not utils.TRITON_ABOVE_3_7_1:
        return "fla's gated chunk backward is refused on Hopper with Triton < 3.7.1 (fla #640)"
    return None


def use_megatron_torch_gdn(gpt) -> int:
    """Point every GatedDeltaNet of `gpt` at megatron-core's own torch chunked kernel
    (`torch_chunk_gated_delta_rule`, what its deterministic mode runs; fla still gives conv1d and
    l2norm). Returns how many layers changed. megatron >= 0.19 picks the kernel per module
    (`gated_delta_rule`); older versions call the module-level name, patched here."""
    from megatron.core.ssm import gated_delta_net

    fallback = gated_delta_net.torch_chunk_gated_delta_rule
    layers = [m for m in gpt.modules() if type(m).__name__ == "GatedDeltaNet"]
    for m in layers:
        if hasattr(m, "gated_delta_rule"):
            m.gated_delta_rule = fallback
        else:
            gated_delta_net.chunk_gated_delta_rule = fallback
    return len(layers)


class UnitOffsetRMSNorm(torch.nn.Module):
    """RMSNorm with weight stored as an offset from 1 (y = x / rms(x) * (1 + w), in fp32, back to
    x's dtype): megatron's zero-centered gamma, with the local norm's constructor."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(
            torch.zeros(hidden_size, dtype=config.params_dtype, device="cpu" if config.use_cpu_initialization else None)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


def config_kwargs(arch) -> dict:
    """TransformerConfig fields Qwen3.5-MoE adds to `megatron.transformer_config`'s."""
    if "linear_attention" not in arch.layer_types:
        return {}
    return dict(
        attention_output_gate=arch.attn_output_gate,
        moe_shared_expert_intermediate_size=arch.shared_expert_intermediate_size or None,
        moe_shared_expert_gate=bool(arch.shared_expert_intermediate_size),
        moe_shared_expert_overlap=False,
        linear_conv_kernel_dim=arch.linear_conv_kernel_dim,
        linear_key_head_dim=arch.linear_key_head_dim,
        linear_value_head_dim=arch.linear_value_head_dim,
        linear_num_key_heads=arch.linear_num_key_heads,
        linear_num_value_heads=arch.linear_num_value_heads,
    )


def decoder_block_spec(config, arch):
    """The local GPT decoder block spec with GatedDeltaNet on the linear-attention layers and the
    (1 + w) norms where `arch.norm_unit_offset` (see the module docstring)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    block.layer_specs = [copy.deepcopy(layer) for layer in block.layer_specs]  # the layers share spec objects
    gdn = ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear
        ),
    )
    for layer, kind in zip(block.layer_specs, arch.layer_types):
        sub = layer.submodules
        if kind == "linear_attention":
            sub.self_attention = gdn
        if arch.norm_unit_offset:
            sub.input_layernorm = sub.pre_mlp_layernorm = UnitOffsetRMSNorm
            if kind != "linear_attention":
                sub.self_attention.submodules.q_layernorm = UnitOffsetRMSNorm
                sub.self_attention.submodules.k_layernorm = UnitOffsetRMSNorm
    if arch.norm_unit_offset:
        block.layer_norm = UnitOffsetRMSNorm
    return block
