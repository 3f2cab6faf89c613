"""The decoder shared by Qwen3.5-MoE and Qwen3-MoE, and `build_causal_lm`.

Module tree and parameter names equal transformers' `...ForCausalLM`:
`model.embed_tokens`, `model.layers.{i}.{input_layernorm, linear_attn | self_attn,
post_attention_layernorm, mlp}`, `model.norm`, `lm_head`; and, for a config with MTP layers, the
checkpoint's `mtp.*` (which transformers drops): `MultiTokenPredictor`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..ops import device, resolve
from ..ops.experts import exact as experts_exact
from ..ops.linear import linear_ref
from ..ops.logprob.exact import exact_logits
from ..ops.rope import rope_cos_sin, rope_inv_freq
from ..ops.varlen import HostOffsets, check_cu_seqlens
from .arch import ArchConfig
from .layers import Attention, DenseMLP, Experts, Linear, MoeBlock, ResolvedOps, RMSNorm
from .mtp import shift_left
from .ops_config import OpsConfig
from .qwen3_5_moe.gated_deltanet import GatedDeltaNet
from .registry import ModelSpec, get_spec

if TYPE_CHECKING:
    from .process_groups import ExpertParallelGroup, UlyssesGroup

logger = logging.getLogger(__name__)


@dataclass
class MoeModelOutput:
    """last_hidden_state: [B, T, D] in the model dtype (after the final norm).
    router_logits: one [B*T, E] tensor (router dtype) per MoE layer, or None when not requested."""

    last_hidden_state: torch.Tensor
    router_logits: tuple[torch.Tensor, ...] | None = None


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (GatedDeltaNet or attention), then MoE / dense MLP.
    The unit for fully_shard and activation checkpointing."""

    def __init__(self, arch: ArchConfig, layer_idx: int, ops: ResolvedOps, factory: dict):
        super().__init__()
        self.layer_type = arch.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(arch, ops, factory)
        else:
            self.self_attn = Attention(arch, ops, factory)
        if arch.mlp_types[layer_idx] == "moe":
            self.mlp = MoeBlock(arch, ops, factory)
        else:
            self.mlp = DenseMLP(arch.hidden_size, arch.intermediate_size, ops, factory)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.norm_unit_offset, ops, factory)
        self.post_attention_layernorm = RMSNorm(
            arch.hidden_size, arch.rms_norm_eps, arch.norm_unit_offset, ops, factory
        )

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        cu_seqlens_cpu: HostOffsets | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The residual stream is carried as (branch output, running sum before it), so each residual
        add is fused into the norm that follows it: the layer's input is residual + hidden (just
        hidden, the embeddings, when residual is None). Returns (MLP output [B, T, D], the running sum
        before it [B, T, D], router_logits [B*T, E] or None for a dense layer); their sum is the
        layer's output hidden state."""
        if residual is None:
            x, residual = self.input_layernorm(hidden), hidden
        else:
            x, residual = self.input_layernorm(hidden, residual=residual)
        if self.layer_type == "linear_attention":
            x = self.linear_attn(x, cu_seqlens, cu_seqlens_cpu)
        else:
            x = self.self_attn(x, cos, sin, cu_seqlens, cu_seqlens_cpu)
        x, residual = self.post_attention_layernorm(x, residual=residual)
        x, router_logits = self.mlp(x)
        return x, residual, router_logits


class MoeTextModel(nn.Module):
    """embed_tokens -> layers -> norm (transformers' `model.` prefix)."""

    def __init__(self, arch: ArchConfig, ops: ResolvedOps, factory: dict):
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size, arch.pad_token_id, **factory)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, ops, factory) for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.norm_unit_offset, ops, factory)

    def rotary(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, rotary_dim] in `dtype`; computed in fp32 (fp64 for an fp64 model) each call,
        so nothing lives in a buffer that meta-device init or sharding would have to handle."""
        cd = torch.float64 if dtype == torch.float64 else torch.float32
        a = self.arch
        inv_freq = rope_inv_freq(
            a.head_dim, a.rope_theta, a.partial_rotary_factor, dtype=cd, device=position_ids.device
        )
        return rope_cos_sin(position_ids, inv_freq, a.mrope_section, dtype=dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        output_router_logits: bool = False,
        inputs_embeds: torch.Tensor | None = None,
        cu_seqlens_cpu: HostOffsets | None = None,
    ) -> MoeModelOutput:
        # inputs_embeds [B, T, D]: the embeddings to use instead of embed_tokens(input_ids) (the
        # vision-language model's, with image features at the placeholders)
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        cos, sin = self.rotary(position_ids, hidden.dtype)
        router_logits = []
        for layer in self.layers:
            hidden, residual, logits = layer(hidden, residual, cos, sin, cu_seqlens, cu_seqlens_cpu)
            if output_router_logits and logits is not None:
                router_logits.append(logits)
        final = self.norm(hidden) if residual is None else self.norm(hidden, residual=residual)[0]
        return MoeModelOutput(final, tuple(router_logits) if output_router_logits else None)


class MultiTokenPredictor(nn.Module):
    """Qwen3.5's multi-token-prediction module, under the checkpoint's names (`mtp.` prefix):
    `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `fc` [D, 2D], `layers.{k}` (full-attention decoder
    layers with the model's MoE block), `norm`; the embedding and lm_head are the main model's. The fc
    and the norms serve every depth (the checkpoint holds one of each, as vLLM reads it).

    Depth k (1..n): h_k = norm(layer_k(fc([norm_e(embedding of token t+k); norm_h(h_{k-1})]))) with
    h_0 the main model's final hidden state; lm_head(h_k) predicts token t+k+1 (`models/mtp.py`).
    Attention uses the positions of t, as the main model's (vLLM's and Megatron's rotary)."""

    def __init__(self, arch: ArchConfig, ops: ResolvedOps, factory: dict):
        super().__init__()
        D, mtp_arch = arch.hidden_size, arch.mtp_arch()
        self.pre_fc_norm_embedding = RMSNorm(D, arch.rms_norm_eps, arch.norm_unit_offset, ops, factory)
        self.pre_fc_norm_hidden = RMSNorm(D, arch.rms_norm_eps, arch.norm_unit_offset, ops, factory)
        self.fc = Linear(2 * D, D, False, ops, factory)
        self.layers = nn.ModuleList(DecoderLayer(mtp_arch, k, ops, factory) for k in range(arch.mtp_num_hidden_layers))
        self.norm = RMSNorm(D, arch.rms_norm_eps, arch.norm_unit_offset, ops, factory)

    def forward(
        self,
        hidden: torch.Tensor,
        next_embeds: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        cu_seqlens_cpu: HostOffsets | None = None,
    ) -> torch.Tensor:
        """hidden [B, T, D]: the main model's final hidden states; next_embeds [n, B, T, D]: for depth k
        the embeddings of token t+k (zero id past a sequence's end); cos / sin as the decoder layers take
        them. Returns [n, B, T, D]: each depth's hidden state after the norm."""
        out = []
        for embeds, layer in zip(next_embeds, self.layers):
            x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
            x, residual, _ = layer(self.fc(x), None, cos, sin, cu_seqlens, cu_seqlens_cpu)
            hidden = self.norm(x, residual=residual)[0]
            out.append(hidden)
        return torch.stack(out)


class MoeCausalLM(nn.Module):
    """Qwen3.5-MoE / Qwen3-MoE causal LM on verl_moe ops.

    forward(input_ids [B, T] long, position_ids [B, T] or [3, B, T] (mRoPE models) long,
    cu_seqlens [N+1] int or None, output_router_logits=False, cu_seqlens_cpu=None) -> MoeModelOutput.
    Packed input is B == 1 with cu_seqlens (position ids restart per sequence); without cu_seqlens
    each row is one sequence. `cu_seqlens_cpu`, the same offsets as host ints (`ops/varlen.py`), spares
    the ops every read of cu_seqlens back from the device. Logits are computed only on request: `model.logits(hidden)`.
    """

    def __init__(self, hf_config, spec: ModelSpec, arch: ArchConfig, ops: ResolvedOps, factory: dict):
        super().__init__()
        self.config, self.spec, self.arch = hf_config, spec, arch
        self.model = MoeTextModel(arch, ops, factory)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False, **factory)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if arch.mtp_num_hidden_layers:
            self.mtp = MultiTokenPredictor(arch, ops, factory)
        self.sequence_parallel: UlyssesGroup | None = None
        self.ops = ops

    def set_sequence_parallel(self, group: UlyssesGroup | None) -> None:
        """Run the token mixers Ulysses-parallel over `group` (None: off). Afterwards `forward` takes
        this rank's contiguous share of one packed row (input_ids / position_ids [1, T/sp]) with
        `cu_seqlens` of the whole row, and returns hidden states of those tokens. Raises ValueError
        when the group's size does not split the head counts."""
        if group is not None:
            bad = self.arch.sequence_parallel_problems(group.size)
            if bad:
                raise ValueError(f"sequence-parallel size {group.size} does not divide the head counts {bad}")
        self.sequence_parallel = group
        for module in self.modules():
            if isinstance(module, Attention | GatedDeltaNet):
                module.sequence_parallel = group

    def set_expert_parallel(self, group: ExpertParallelGroup | None) -> None:
        """Split the routed experts of every MoE layer over `group` (None: off). The caller places
        each rank's expert block (E / group.size experts, in rank order) in the expert weights;
        raises ValueError when the group's size does not divide the expert count."""
        if group is not None and self.arch.num_experts % group.size:
            raise ValueError(f"expert-parallel size {group.size} does not divide num_experts={self.arch.num_experts}")
        for module in self.modules():
            if isinstance(module, Experts):
                module.expert_parallel = group

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        output_router_logits: bool = False,
        cu_seqlens_cpu: HostOffsets | None = None,
    ) -> MoeModelOutput:
        self.check_inputs(input_ids, position_ids, cu_seqlens, cu_seqlens_cpu)
        return self.model(input_ids, position_ids, cu_seqlens, output_router_logits, cu_seqlens_cpu=cu_seqlens_cpu)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> logits [..., VOCAB]: in the model dtype, or in exact mode fp32 by the trainer
        head's own product (`ops.logprob.exact.exact_logits`)."""
        return self.ops.logits(hidden, self.lm_head.weight)

    def mtp_hidden_states(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        cu_seqlens_cpu: HostOffsets | None = None,
        detach_inputs: bool = False,
    ) -> torch.Tensor:
        """The MTP module over a forward's output: hidden [B, T, D] (`forward`'s last_hidden_state) and the
        forward's input_ids / position_ids / cu_seqlens -> [n, B, T, D], depth k's hidden state at t (its
        logits predict token t+k+1; `models/mtp.py::mtp_targets` says which positions count). Token ids are
        shifted within each sequence, never across a packed boundary. detach_inputs: the hidden states and
        embeddings enter detached (the MTP loss then trains the MTP module and lm_head only). Raises
        ValueError for a model without MTP layers."""
        mtp = getattr(self, "mtp", None)
        if mtp is None:
            raise ValueError(f"{self.arch.mtp_num_hidden_layers=}: this model has no MTP layers")
        if position_ids.dim() == 3 and position_ids.shape[0] == 4:  # verl's text row, then the mRoPE rows
            position_ids = position_ids[1:]
        text = self.model.language_model if hasattr(self.model, "language_model") else self.model
        shifted = [shift_left(input_ids, k, cu_seqlens)[0] for k in range(1, len(mtp.layers) + 1)]
        next_embeds = text.embed_tokens(torch.stack(shifted))
        if detach_inputs:
            hidden, next_embeds = hidden.detach(), next_embeds.detach()
        cos, sin = text.rotary(position_ids, hidden.dtype)
        return mtp(hidden, next_embeds, cos, sin, cu_seqlens, cu_seqlens_cpu)

    def check_inputs(self, input_ids, position_ids, cu_seqlens, cu_seqlens_cpu=None) -> None:
        """Raise ValueError on inputs the forward cannot take, before any compute."""
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"input_ids must be [B, T] int, got {tuple(input_ids.shape)} {input_ids.dtype}")
        B, T = input_ids.shape
        if position_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"position_ids must be int32/int64, got {position_ids.dtype}")
        shapes = [(B, T)] + ([(3, B, T)] if self.arch.mrope_section is not None else [])
        if tuple(position_ids.shape) not in shapes:
            raise ValueError(
                f"position_ids must have shape {' or '.join(map(str, shapes))}, got {tuple(position_ids.shape)}"
            )
        if cu_seqlens is not None:
            if B != 1:
                raise ValueError(f"packed input (cu_seqlens) needs B == 1, got B={B}")
            # under sequence parallelism cu_seqlens describes the whole row, of which T is one share
            check_cu_seqlens(
                cu_seqlens, T * (self.sequence_parallel.size if self.sequence_parallel else 1), cu_seqlens_cpu
            )
        elif self.sequence_parallel is not None:
            raise ValueError("sequence-parallel forward needs packed input (cu_seqlens)")


def check_exact_mode(dtype: torch.dtype) -> None:
    """Raise ValueError (one line) where exact mode cannot hold: on npu (its Triton forms have not run on
    Ascend's cube units, whose dot tiling is unverified: the first op is named), for fp64 models, and on
    cpu with torch's vector kernels, whose exp / silu / sigmoid / cos round differently in a loop's scalar
    tail than in its vector body, so a token's result would depend on where it sits in the batch
    (`ATEN_CPU_CAPABILITY=default` gives every loop the scalar code)."""
    if device.device_type() == "npu":
        raise ValueError(
            "OpsConfig.exact: op 'linear' has no verified exact form on npu (exact mode runs on cuda and cpu)"
        )
    if dtype == torch.float64:
        raise ValueError("OpsConfig.exact is for bf16 / fp16 / fp32 models (an fp64 model is a reference already)")
    if device.is_accelerator():
        return
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "DEFAULT":
        raise ValueError(
            f"OpsConfig.exact on cpu needs torch's scalar cpu kernels, this process runs its {capability} ones: "
            "start it with ATEN_CPU_CAPABILITY=default"
        )


def resolve_ops(ops: OpsConfig, arch: ArchConfig, dtype: torch.dtype) -> ResolvedOps:
    """Resolve every op the architecture needs for training and decoding, once (dispatch logs each
    choice). In an fp64 model (a reference) "auto" means each op's torch code on every device, whatever
    VERL_MOE_OPS says: the kernels compute in at most fp32 and refuse fp64 inputs. Attention's "auto" is
    the torch code for an fp32 model too: flash attention (the varlen default on cuda) takes 16-bit inputs
    only. In exact mode (`OpsConfig.exact`) every op is its exact form.

    Raises:
        ValueError: an unknown or unrunnable implementation, or exact mode on a device where an op has
            no exact form yet (the op is named).
    """
    linear = "linear_attention" in arch.layer_types
    attention = "full_attention" in arch.layer_types
    if ops.exact:
        check_exact_mode(dtype)
        if device.is_accelerator():
            # whether the experts' decode tiles give their training tiles' bits here, measured now: a decode
            # step's first call may be inside a device-graph capture, where nothing can be measured
            experts_exact.decode_tiles_agree(dtype)

    def pick(op: str, needed: bool = True):
        if not needed:
            return None
        wide = dtype == torch.float64 or (op == "attention" and dtype == torch.float32)
        return resolve(op, ops.impl(op) or ("torch" if wide else None))

    return ResolvedOps(
        norm=pick("norm"),
        rope=pick("rope"),
        linear=pick("linear"),
        logits=exact_logits if ops.exact else linear_ref,
        attention=pick("attention", attention),
        attention_decode=pick("attention.decode", attention),
        attention_cached=pick("attention.cached", attention),
        router=pick("router"),
        experts=pick("experts"),
        sampling=pick("sampling"),
        router_dtype=ops.router_torch_dtype(dtype),
        gdn=pick("gdn", linear),
        gdn_step=pick("gdn.step", linear),
        gdn_positions=pick("gdn.positions", linear),
        conv1d=pick("conv1d", linear),
        conv1d_step=pick("conv1d.step", linear),
        conv1d_positions=pick("conv1d.positions", linear),
        exact=ops.exact,
    )


@torch.no_grad()
def init_modules(modules, std: float) -> None:
    """transformers-like init of `modules` in order: normal(0, std) for projections, embeddings,
    convolutions, router and experts; zero biases; norms and GatedDeltaNet gates keep their own reset."""
    for module in modules:
        if isinstance(module, nn.Linear | nn.Embedding | nn.Conv1d | nn.Conv3d):
            nn.init.normal_(module.weight, 0.0, std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, MoeBlock):
            nn.init.normal_(module.gate.weight, 0.0, std)
            nn.init.normal_(module.experts.gate_up_proj, 0.0, std)
            nn.init.normal_(module.experts.down_proj, 0.0, std)


@torch.no_grad()
def zero_padding_embedding(embed: nn.Embedding) -> None:
    if embed.padding_idx is not None:
        embed.weight[embed.padding_idx].zero_()


def init_weights(model: MoeCausalLM) -> None:
    """`init_modules` over the whole model with the config's initializer_range; a tied lm_head
    (visited last) re-initialises the shared embedding, then its padding row is zeroed."""
    init_modules(model.modules(), model.arch.initializer_range)
    zero_padding_embedding(model.model.embed_tokens)


def build_causal_lm(
    hf_config,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    ops: OpsConfig | Mapping | None = None,
    compute_dtype: torch.dtype | None = None,
) -> MoeCausalLM:
    """A freshly initialised MoeCausalLM for a text HF config (`verl_moe.models.build`, in factory.py,
    also takes the vision-language one).

    Args:
        hf_config: a transformers config of model_type `qwen3_5_moe_text` or `qwen3_moe`.
        dtype: parameter dtype. device: where parameters live ("meta" allocates nothing).
        ops: implementation choices: an OpsConfig, a mapping of its fields (a Hydra config's
            dict), or None for OpsConfig() (auto everywhere, fp32 router).
        compute_dtype: the dtype the layers compute in when it is not the parameters' (FSDP mixed
            precision casts fp32 master weights to bf16): "auto" ops are chosen for it. None: dtype.
    Raises:
        ValueError: unsupported model_type or a vision-language one, invalid or unsupported config,
            unknown op implementation or `ops` key.
        TypeError: `ops` is neither an OpsConfig, a mapping nor None.
    """
    spec = get_spec(hf_config.model_type)
    if spec.vision_arch is not None:
        raise ValueError(f"{hf_config.model_type} is a vision-language config: build it with verl_moe.models.build")
    text_config = spec.text_config(hf_config)
    arch = spec.arch_config(text_config)
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be floating point, got {dtype}")
    resolved = resolve_ops(OpsConfig.coerce(ops), arch, compute_dtype or dtype)
    model = MoeCausalLM(text_config, spec, arch, resolved, {"dtype": dtype, "device": torch.device(device)})
    init_weights(model)
    return model
