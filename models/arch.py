"""`ArchConfig`: everything the shared decoder needs, read once from an HF config and validated.

Each family (`models/qwen3_5_moe/config.py`, `models/qwen3_moe/config.py`) turns its HF config
into one of these; the modules in `layers.py` / `causal_lm.py` read only this object, so an
invalid combination fails here, before any parameter is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class ArchConfig:
    """Shapes and switches of a Qwen3.5-MoE / Qwen3-MoE decoder (alphabet of the style guide).

    Attributes:
        vocab_size: VOCAB. hidden_size: D. rms_norm_eps: eps of every RMSNorm.
        layer_types: per layer "linear_attention" (GatedDeltaNet) or "full_attention".
        mlp_types: per layer "moe" or "dense" (Qwen3-MoE `mlp_only_layers` / `decoder_sparse_step`).
        norm_unit_offset: RMSNorm weights multiply as (1 + w) (Qwen3.5) instead of w (Qwen3-MoE).
        num_attention_heads / num_key_value_heads / head_dim: H, HKV, K of full attention.
        attention_bias: q/k/v/o projections carry a bias.
        attn_output_gate: q_proj also emits a per-head sigmoid gate on the attention output (Qwen3.5).
        rope_theta, partial_rotary_factor: rotary base and share of head_dim that rotates.
        mrope_section: interleaved mRoPE sections (Qwen3.5) or None for plain RoPE.
        linear_num_key_heads / linear_num_value_heads / linear_key_head_dim / linear_value_head_dim /
            linear_conv_kernel_dim: H, HV, K, V, W of the GatedDeltaNet layers (0 when absent).
        num_experts / num_experts_per_tok / moe_intermediate_size: E, TOPK, I.
        norm_topk_prob: renormalise the TOPK router probabilities.
        shared_expert_intermediate_size: width of the sigmoid-gated shared expert, 0 for none.
        intermediate_size: width of dense MLP layers (0 when every layer is MoE).
        tie_word_embeddings: lm_head shares embed_tokens' weight.
        initializer_range: std of the normal init of fresh weights.
        pad_token_id: embedding row that gets no gradient (transformers' `padding_idx`), in
            [0, vocab_size) (transformers' own rule), or None.
        mtp_num_hidden_layers: decoder layers of the multi-token-prediction module (Qwen3.5's `mtp.*`,
            `models/mtp.py`); 0 for none. Each is a full-attention layer with the model's MoE block.
    """

    vocab_size: int
    hidden_size: int
    rms_norm_eps: float
    layer_types: tuple[str, ...]
    mlp_types: tuple[str, ...]
    norm_unit_offset: bool
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    attn_output_gate: bool
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, int, int] | None
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int
    intermediate_size: int
    tie_word_embeddings: bool
    initializer_range: float
    pad_token_id: int | None = None
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    mtp_num_hidden_layers: int = 0

    def __post_init__(self):
        n = len(self.layer_types)
        if n == 0:
            raise ValueError("the model needs at least one layer (num_hidden_layers >= 1)")
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"unknown layer type(s) {bad}; supported: {list(LAYER_TYPES)}")
        if len(self.mlp_types) != n or any(t not in ("moe", "dense") for t in self.mlp_types):
            raise ValueError(f"mlp_types must be {n} entries of 'moe'/'dense', got {list(self.mlp_types)}")
        for name in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"pad_token_id={self.pad_token_id} must be None or a token id in [0, vocab_size={self.vocab_size})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        rotary_dim = int(self.head_dim * self.partial_rotary_factor)
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > self.head_dim:
            raise ValueError(
                f"rotary dim int(head_dim {self.head_dim} * partial_rotary_factor "
                f"{self.partial_rotary_factor}) = {rotary_dim} must be even and in (0, head_dim]"
            )
        if self.mrope_section is not None and (len(self.mrope_section) != 3 or min(self.mrope_section) < 0):
            raise ValueError(f"mrope_section must be three non-negative ints, got {self.mrope_section}")
        if "linear_attention" in self.layer_types:
            dims = (
                "linear_num_key_heads",
                "linear_num_value_heads",
                "linear_key_head_dim",
                "linear_value_head_dim",
                "linear_conv_kernel_dim",
            )
            for name in dims:
                if getattr(self, name) <= 0:
                    raise ValueError(f"{name} must be positive for linear_attention layers, got {getattr(self, name)}")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(
                    f"linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
                    f"linear_num_key_heads={self.linear_num_key_heads} (GVA)"
                )
        if "moe" in self.mlp_types:
            if self.num_experts <= 0 or self.moe_intermediate_size <= 0:
                raise ValueError(
                    f"MoE layers need num_experts > 0 and moe_intermediate_size > 0, got "
                    f"{self.num_experts}, {self.moe_intermediate_size}"
                )
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]"
                )
        if "dense" in self.mlp_types and self.intermediate_size <= 0:
            raise ValueError(f"dense MLP layers need intermediate_size > 0, got {self.intermediate_size}")
        if not isinstance(self.mtp_num_hidden_layers, int) or self.mtp_num_hidden_layers < 0:
            raise ValueError(f"mtp_num_hidden_layers must be an int >= 0, got {self.mtp_num_hidden_layers!r}")
        if self.mtp_num_hidden_layers and "moe" not in self.mlp_types:
            raise ValueError("MTP layers carry the model's MoE block: a model without MoE layers cannot have them")

    def sequence_parallel_problems(self, sp: int) -> dict[str, int]:
        """Head counts Ulysses SP of size `sp` cannot split, by field name (empty when it can):
        query heads and GatedDeltaNet key / value heads (with their conv channels) must divide by
        `sp`; attention key/value heads must divide by `sp` or divide `sp` (each rank then gets
        one replicated kv head)."""
        problems = {}
        if self.num_attention_heads % sp:
            problems["num_attention_heads"] = self.num_attention_heads
        kv = self.num_key_value_heads
        if kv % sp and sp % kv:
            problems["num_key_value_heads"] = kv
        if "linear_attention" in self.layer_types:
            for name in ("linear_num_key_heads", "linear_num_value_heads"):
                if getattr(self, name) % sp:
                    problems[name] = getattr(self, name)
        return problems

    def mtp_arch(self) -> ArchConfig:
        """The architecture of the MTP module's decoder layers: `mtp_num_hidden_layers` full-attention MoE
        layers, same shapes as the main decoder's."""
        n = self.mtp_num_hidden_layers
        return replace(self, layer_types=("full_attention",) * n, mlp_types=("moe",) * n, mtp_num_hidden_layers=0)

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)
