"""Incremental decoding over the module tree of `MoeCausalLM`: prefill prompts into a decode
state, then advance every sequence one token per step. The rollout's generation path.

The decoder calls the model's own submodules, weights and resolved ops (norms, projections, rope,
the packed attention / conv / gated-delta-rule ops for the prefill, MoE blocks as they are), so it
computes what `MoeCausalLM.forward` computes; only the two token mixers are re-walked here,
because their decode form keeps state:

- full attention: a KV cache [N, HKV, L, K] per layer (k after k_norm and rope), L a capacity
  the state grows on demand; a step writes position `lengths[n]` and attends to positions
  `< lengths[n] + 1` (grouped heads as SDPA query rows, no head repeat);
- GatedDeltaNet: the conv state [N, C, W-1] (last W-1 conv inputs, `ops/conv1d/step.py`) and the
  recurrent state [N, HV, K, V] in fp32 (`ops/gdn/step.py`).

Positions continue from the prompt (text: one row; mRoPE models get three identical rows).
The model must be local: no sequence or expert parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..ops import resolve
from ..ops.conv1d.step import conv1d_state_from_prefill
from .causal_lm import MoeCausalLM
from .layers import Attention, Experts
from .qwen3_5_moe.model import GatedDeltaNet


@dataclass
class AttentionCache:
    """k, v: [N, HKV, L, K] in the model dtype; positions >= a sequence's length are unused."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass
class LinearCache:
    """conv: [N, C, W-1] in the model dtype; recurrent: [N, HV, K, V] fp32 (fp64 for fp64 models)."""

    conv: torch.Tensor
    recurrent: torch.Tensor


@dataclass
class DecodeState:
    """Per-sequence state of N sequences. lengths: [N] int64 tokens consumed (= next position);
    layers: one cache per decoder layer."""

    lengths: torch.Tensor
    layers: list[AttentionCache | LinearCache]

    @property
    def num_seqs(self) -> int:
        return self.lengths.numel()

    @property
    def capacity(self) -> int | None:
        """KV positions each attention cache holds (None without attention layers)."""
        for cache in self.layers:
            if isinstance(cache, AttentionCache):
                return cache.k.shape[2]
        return None

    def select(self, index: torch.Tensor | Sequence[int]) -> DecodeState:
        """The state of the sequences at `index` (in that order), as new tensors."""
        index = torch.as_tensor(index, dtype=torch.long, device=self.lengths.device)
        layers = []
        for cache in self.layers:
            if isinstance(cache, AttentionCache):
                layers.append(AttentionCache(cache.k[index], cache.v[index]))
            else:
                layers.append(LinearCache(cache.conv[index], cache.recurrent[index]))
        return DecodeState(self.lengths[index], layers)

    def reserve(self, capacity: int) -> None:
        """Grow every KV cache to hold at least `capacity` positions (no-op when it does)."""
        for cache in self.layers:
            if isinstance(cache, AttentionCache) and cache.k.shape[2] < capacity:
                pad = capacity - cache.k.shape[2]
                cache.k = F.pad(cache.k, (0, 0, 0, pad))
                cache.v = F.pad(cache.v, (0, 0, 0, pad))

    @staticmethod
    def concat(states: Sequence[DecodeState]) -> DecodeState:
        """One state holding the sequences of `states` in order (KV caches padded to the largest)."""
        if len(states) == 1:
            return states[0]
        capacity = max((s.capacity or 0) for s in states)
        for s in states:
            s.reserve(capacity)
        layers = []
        for caches in zip(*(s.layers for s in states)):
            if isinstance(caches[0], AttentionCache):
                layers.append(AttentionCache(torch.cat([c.k for c in caches]), torch.cat([c.v for c in caches])))
            else:
                layers.append(
                    LinearCache(torch.cat([c.conv for c in caches]), torch.cat([c.recurrent for c in caches]))
                )
        return DecodeState(torch.cat([s.lengths for s in states]), layers)


class MoeDecoder:
    """Prefill and one-token steps for a local `MoeCausalLM`.

    `prefill(prompts, capacity)` -> (logits [N, VOCAB] of each prompt's last token, state);
    `step(tokens [N], state)` -> logits [N, VOCAB] of those tokens (the state advances in place).
    Logits are in the model dtype. The step ops resolve once here: `gdn.step` by the usual rule
    (torch on CPU and for fp64 models), `conv1d.step` has only its torch implementation.
    """

    def __init__(self, model: MoeCausalLM, gdn_step_impl: str | None = None):
        if model.sequence_parallel is not None:
            raise ValueError("decoding needs a model without sequence parallelism")
        if any(isinstance(m, Experts) and m.expert_parallel is not None for m in model.modules()):
            raise ValueError("decoding needs a model without expert parallelism")
        self.model = model
        self.arch = model.arch
        dtype = next(model.parameters()).dtype
        self.dtype = dtype
        linear = "linear_attention" in self.arch.layer_types
        auto = "torch" if dtype == torch.float64 else None
        self.gdn_step = resolve("gdn.step", gdn_step_impl or auto) if linear else None
        self.conv_step = resolve("conv1d.step", "torch") if linear else None

    # ---- prefill -----------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, prompts: Sequence[Sequence[int]], capacity: int = 0) -> tuple[torch.Tensor, DecodeState]:
        """Run the prompts packed in one row (cu_seqlens) and keep their state.

        Args:
            prompts: N non-empty token-id lists.
            capacity: KV positions to allocate per sequence (at least the longest prompt).
        Returns:
            logits [N, VOCAB] at each prompt's last token; the DecodeState after the prompts.
        Raises:
            ValueError: no prompts, an empty prompt, or a token id outside the vocabulary.
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prefill needs at least one prompt, each with at least one token")
        device = self.model.lm_head.weight.device
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
        if ids.min() < 0 or ids.max() >= self.arch.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.arch.vocab_size}), got {ids.min()}..{ids.max()}")
        cu = torch.zeros(len(prompts) + 1, dtype=torch.int32)
        cu[1:] = lengths.cumsum(0)
        positions = torch.cat([torch.arange(n) for n in lengths.tolist()])
        ids, positions, cu = ids[None].to(device), positions[None].to(device), cu.to(device)
        capacity = max(capacity, int(lengths.max()))

        text = self.model.model
        hidden = text.embed_tokens(ids)
        cos, sin = text.rotary(positions, hidden.dtype)
        caches = []

        def mixer(layer, x):
            if layer.layer_type == "linear_attention":
                x, cache = self._gdn_prefill(layer.linear_attn, x, cu)
            else:
                x, cache = self._attention_prefill(layer.self_attn, x, cos, sin, cu, capacity)
            caches.append(cache)
            return x

        hidden, residual = self._layers(hidden, mixer)
        last = cu[1:].long() - 1  # each prompt's last token
        logits = self._logits(hidden[0, last], residual[0, last])
        return logits, DecodeState(lengths.to(device), caches)

    def _attention_prefill(self, attn: Attention, x, cos, sin, cu, capacity):
        q, k, v, gate = self._attention_qkv(attn, x, cos, sin)
        o = attn.ops.attention(q, k, v, scale=attn.head_dim**-0.5, cu_seqlens=cu)
        N = cu.numel() - 1
        kc = k.new_zeros(N, attn.num_kv_heads, capacity, attn.head_dim)
        vc = v.new_zeros(N, attn.num_kv_heads, capacity, v.shape[-1])
        bounds = cu.tolist()
        for n in range(N):
            s, e = bounds[n], bounds[n + 1]
            kc[n, :, : e - s] = k[0, s:e].transpose(0, 1)
            vc[n, :, : e - s] = v[0, s:e].transpose(0, 1)
        return self._attention_out(attn, o, gate), AttentionCache(kc, vc)

    def _gdn_prefill(self, gdn: GatedDeltaNet, x, cu):
        B, T, _ = x.shape
        mixed_qkv = gdn.in_proj_qkv(x)
        conv_weight = gdn.conv1d.weight.squeeze(1)
        conv_state = conv1d_state_from_prefill(mixed_qkv, conv_weight.shape[1], cu)
        qkv = gdn.ops.conv1d(mixed_qkv, conv_weight, None, activation="silu", cu_seqlens=cu)
        q, k, v = self._split_qkv(gdn, qkv)
        g, beta = self._gates(gdn, gdn.in_proj_a(x), gdn.in_proj_b(x))
        o, state = gdn.ops.gdn(
            q,
            k,
            v,
            g,
            beta,
            scale=None,
            initial_state=None,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu,
        )
        z = gdn.in_proj_z(x).reshape(B, T, gdn.num_v_heads, gdn.head_v_dim)
        o = gdn.norm(o, gate=z)
        return gdn.out_proj(o.reshape(B, T, gdn.value_dim)), LinearCache(conv_state, state.to(self._state_dtype))

    # ---- one token ---------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """Feed one token per sequence; returns logits [N, VOCAB] and advances `state` in place.

        Args:
            tokens: [N] int token ids, row n continuing sequence n of `state`.
        Raises:
            ValueError: tokens not [N] for the state's N.
        """
        N = state.num_seqs
        if tokens.dim() != 1 or tokens.numel() != N:
            raise ValueError(f"tokens must be [N] with N={N}, got {tuple(tokens.shape)}")
        text = self.model.model
        positions = state.lengths[:, None]  # [N, 1]
        need, capacity = int(state.lengths.max()) + 1, state.capacity
        if capacity is not None and capacity < need:
            state.reserve(max(need, 2 * capacity))  # grow geometrically: a pad copies every cache
        hidden = text.embed_tokens(tokens.to(positions.device)[:, None])  # [N, 1, D]
        cos, sin = text.rotary(positions, hidden.dtype)
        caches = iter(state.layers)

        def mixer(layer, x):
            if layer.layer_type == "linear_attention":
                return self._gdn_step(layer.linear_attn, x, next(caches))
            return self._attention_step(layer.self_attn, x, cos, sin, next(caches), state.lengths)

        hidden, residual = self._layers(hidden, mixer)
        state.lengths = state.lengths + 1
        return self._logits(hidden[:, 0], residual[:, 0])

    def _attention_step(self, attn: Attention, x, cos, sin, cache: AttentionCache, lengths):
        q, k, v, gate = self._attention_qkv(attn, x, cos, sin)  # [N, 1, H | HKV, K]
        N = x.shape[0]
        rows = torch.arange(N, device=lengths.device)
        cache.k[rows, :, lengths] = k[:, 0]
        cache.v[rows, :, lengths] = v[:, 0]
        L = int(lengths.max()) + 1
        HKV, group = attn.num_kv_heads, attn.num_heads // attn.num_kv_heads
        # query head h reads kv head h // group: the group's heads act as SDPA query rows
        qg = q[:, 0].reshape(N, HKV, group, attn.head_dim)
        visible = torch.arange(L, device=lengths.device)[None, :] <= lengths[:, None]  # [N, L]
        o = F.scaled_dot_product_attention(
            qg, cache.k[:, :, :L], cache.v[:, :, :L], attn_mask=visible[:, None, None, :], scale=attn.head_dim**-0.5
        )  # [N, HKV, group, V]
        return self._attention_out(attn, o.reshape(N, 1, attn.num_heads, -1), gate)

    def _gdn_step(self, gdn: GatedDeltaNet, x, cache: LinearCache):
        N = x.shape[0]
        x = x[:, 0]  # [N, D]
        conv_weight = gdn.conv1d.weight.squeeze(1)
        qkv, cache.conv = self.conv_step(gdn.in_proj_qkv(x), cache.conv, conv_weight, None, activation="silu")
        q, k, v = self._split_qkv(gdn, qkv[:, None])
        g, beta = self._gates(gdn, gdn.in_proj_a(x), gdn.in_proj_b(x))
        o, cache.recurrent = self.gdn_step(
            q[:, 0], k[:, 0], v[:, 0], g, beta, cache.recurrent, use_qk_l2norm_in_kernel=True
        )
        o = gdn.norm(o, gate=gdn.in_proj_z(x).reshape(N, gdn.num_v_heads, gdn.head_v_dim))
        return gdn.out_proj(o.reshape(N, 1, gdn.value_dim))

    # ---- the layer walk, shared by prefill and step -------------------------------------------

    def _layers(self, hidden, mixer):
        """`MoeTextModel.forward`'s walk with `mixer(layer, x)` in place of each token mixer: the
        residual stream is carried as (branch output, running sum) and every residual add runs in
        the norm after it, exactly as the model does (the same ops, hence the same rounding).
        Returns (last MLP output, running sum before it)."""
        residual = None
        for layer in self.model.model.layers:
            if residual is None:
                x, residual = layer.input_layernorm(hidden), hidden
            else:
                x, residual = layer.input_layernorm(hidden, residual=residual)
            x, residual = layer.post_attention_layernorm(mixer(layer, x), residual=residual)
            hidden, _ = layer.mlp(x)
        return hidden, residual

    def _logits(self, hidden, residual):
        """Final norm of residual + hidden, then the LM head."""
        return self.model.logits(self.model.model.norm(hidden, residual=residual)[0])

    # ---- shared pieces of the two mixers -----------------------------------------------------

    @staticmethod
    def _attention_qkv(attn: Attention, x, cos, sin):
        """q [B, T, H, K], k / v [B, T, HKV, K] after norms and rope, and the output gate (or None)."""
        B, T, _ = x.shape
        q = attn.q_proj(x).view(B, T, attn.num_heads, -1)
        gate = None
        if attn.output_gate:
            q, gate = q.split(attn.head_dim, dim=-1)
        q = attn.q_norm(q)
        k = attn.k_norm(attn.k_proj(x).view(B, T, attn.num_kv_heads, attn.head_dim))
        v = attn.v_proj(x).view(B, T, attn.num_kv_heads, attn.head_dim)
        q, k = attn.ops.rope(q, k, cos, sin)
        return q, k, v, gate

    @staticmethod
    def _attention_out(attn: Attention, o, gate):
        """o [B, T, H, V] -> o_proj(o * sigmoid(gate)) [B, T, D]."""
        B, T = o.shape[:2]
        o = o.reshape(B, T, -1)
        if gate is not None:
            o = o * torch.sigmoid(gate.reshape(B, T, -1))
        return attn.o_proj(o)

    @staticmethod
    def _split_qkv(gdn: GatedDeltaNet, qkv):
        """Conv output [B, T, C] -> q, k [B, T, H, K], v [B, T, HV, V]."""
        B, T, _ = qkv.shape
        q, k, v = qkv.split([gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
        return (
            q.reshape(B, T, gdn.num_k_heads, gdn.head_k_dim),
            k.reshape(B, T, gdn.num_k_heads, gdn.head_k_dim),
            v.reshape(B, T, gdn.num_v_heads, gdn.head_v_dim),
        )

    @staticmethod
    def _gates(gdn: GatedDeltaNet, a, b):
        """g = -exp(A_log) softplus(a + dt_bias) in fp32 (fp64 for fp64 models), beta = sigmoid(b)."""
        cd = torch.float64 if gdn.A_log.dtype == torch.float64 else torch.float32
        g = -gdn.A_log.to(cd).exp() * F.softplus(a.to(cd) + gdn.dt_bias.to(cd))
        return g, torch.sigmoid(b)

    @property
    def _state_dtype(self) -> torch.dtype:
        return torch.float64 if self.dtype == torch.float64 else torch.float32


__all__ = ["AttentionCache", "DecodeState", "LinearCache", "MoeDecoder"]
