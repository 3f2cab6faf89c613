"""Incremental decoding over the module tree of `MoeCausalLM` into fixed decode slots: prefill
prompts into free slots, then advance the slots one token per step. The rollout's generation path.

The decoder calls the model's own submodules, weights and resolved ops (norms, projections, rope,
the packed attention / conv / gated-delta-rule ops for the prefill, MoE blocks as they are), so it
computes what `MoeCausalLM.forward` computes; only the two token mixers are re-walked here,
because their decode form keeps state. The state (`SlotState`) is allocated once for S slots:

- full attention: a KV cache [S, HKV, L, K] per layer (k after k_norm and rope), L the capacity;
  a step writes position `lengths[s]` and attends over the whole fixed-shape cache with the
  positions `> lengths[s]` masked (grouped heads as SDPA query rows, no head repeat);
- GatedDeltaNet: the conv state [S, C, W-1] (last W-1 conv inputs, `ops/conv1d/step.py`) and the
  recurrent state [S, HV, K, V] in fp32 (`ops/gdn/step.py`), stepped in place.

A step runs slots [0, B) with an `active` mask: inactive slots (free, or finished since the caller
last looked) keep their state and length exactly, so one step of fixed shape serves any mix of
running and idle slots, reads no lengths on the host and can be captured once as a graph
(`StepGraphs`). Positions continue from the prompt (text: one row; mRoPE models get three identical
rows). The model must be local: no sequence or expert parallelism.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..ops import device, resolve
from ..ops.conv1d.step import conv1d_state_from_prefill
from .causal_lm import MoeCausalLM
from .layers import Attention, Experts
from .qwen3_5_moe.gated_deltanet import GatedDeltaNet

logger = logging.getLogger(__name__)


@dataclass
class AttentionCache:
    """k, v: [S, HKV, L, K] in the model dtype; positions >= a slot's length are unused."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass
class LinearCache:
    """conv: [S, C, W-1] in the model dtype; recurrent: [S, HV, K, V] fp32 (fp64 for fp64 models)."""

    conv: torch.Tensor
    recurrent: torch.Tensor


@dataclass
class SlotState:
    """The decode state of S slots. lengths: [S] int64 tokens consumed (= next position) on the
    model's device; layers: one cache per decoder layer; version: bumped whenever the tensors are
    reallocated (what a captured graph must check)."""

    lengths: torch.Tensor
    layers: list[AttentionCache | LinearCache]
    version: int = 0

    @property
    def num_slots(self) -> int:
        return self.lengths.numel()

    @property
    def capacity(self) -> int | None:
        """KV positions each slot holds (None without attention layers: any length fits)."""
        for cache in self.layers:
            if isinstance(cache, AttentionCache):
                return cache.k.shape[2]
        return None

    @property
    def nbytes(self) -> dict[str, int]:
        """Bytes held: {"kv": attention caches, "linear": conv + recurrent states}."""
        kv = sum(c.k.nbytes + c.v.nbytes for c in self.layers if isinstance(c, AttentionCache))
        linear = sum(c.conv.nbytes + c.recurrent.nbytes for c in self.layers if isinstance(c, LinearCache))
        return {"kv": kv, "linear": linear}

    def resize(self, num_slots: int, capacity: int) -> None:
        """Reallocate to `num_slots` slots of `capacity` KV positions (neither may shrink), keeping
        every slot's state: one copy, done rarely (the caller grows geometrically)."""
        if num_slots < self.num_slots or (self.capacity is not None and capacity < self.capacity):
            raise ValueError("slot state can only grow")
        S = self.num_slots

        def grown(t: torch.Tensor, *tail: int) -> torch.Tensor:
            new = t.new_zeros(num_slots, *tail)
            new[(slice(0, S),) + tuple(slice(0, n) for n in t.shape[1:])] = t
            return new

        for cache in self.layers:
            if isinstance(cache, AttentionCache):
                cache.k = grown(cache.k, cache.k.shape[1], capacity, cache.k.shape[3])
                cache.v = grown(cache.v, cache.v.shape[1], capacity, cache.v.shape[3])
            else:
                cache.conv = grown(cache.conv, *cache.conv.shape[1:])
                cache.recurrent = grown(cache.recurrent, *cache.recurrent.shape[1:])
        self.lengths = grown(self.lengths)
        self.version += 1

    def move(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy slots `src` into slots `dst` (state and length), e.g. to pack running sequences into
        the lowest slots; the other slots are not touched."""
        src_t = torch.as_tensor(list(src), dtype=torch.long, device=self.lengths.device)
        dst_t = torch.as_tensor(list(dst), dtype=torch.long, device=self.lengths.device)
        tensors = [self.lengths]
        for cache in self.layers:
            tensors += [cache.k, cache.v] if isinstance(cache, AttentionCache) else [cache.conv, cache.recurrent]
        for t in tensors:
            t[dst_t] = t[src_t]


class MoeDecoder:
    """Prefill into slots and one-token steps over slots for a local `MoeCausalLM`.

    `allocate(num_slots, capacity)` -> an empty SlotState;
    `prefill(prompts, state, slots)` -> logits [N, VOCAB] of each prompt's last token (the prompts'
    state written into `slots`); `step(tokens [B], state, active [B])` -> logits [B, VOCAB] of those
    tokens for slots [0, B) (the active slots advance in place). Logits are in the model dtype.
    The step ops resolve once here: `gdn.step` by the usual rule (torch on CPU and for fp64
    models), as do `conv1d.step` and `attention.decode`.
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
        self.device = model.lm_head.weight.device
        linear = "linear_attention" in self.arch.layer_types
        auto = "torch" if dtype == torch.float64 else None
        self.gdn_step = resolve("gdn.step", gdn_step_impl or auto) if linear else None
        self.conv_step = resolve("conv1d.step", auto) if linear else None
        attention = "full_attention" in self.arch.layer_types
        self.decode_attention = resolve("attention.decode", auto) if attention else None

    # ---- the slots -----------------------------------------------------------------------------

    def allocate(self, num_slots: int, capacity: int) -> SlotState:
        """Zeroed state for `num_slots` slots of `capacity` KV positions each."""
        if num_slots < 1 or capacity < 1:
            raise ValueError(f"need at least one slot and one position, got {num_slots} x {capacity}")
        layers = []
        for layer in self.model.model.layers:
            if layer.layer_type == "linear_attention":
                gdn = layer.linear_attn
                conv = torch.zeros(num_slots, gdn.conv1d.weight.shape[0], gdn.conv1d.weight.shape[-1] - 1)
                rec = torch.zeros(num_slots, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim, dtype=self._state_dtype)
                layers.append(LinearCache(conv.to(self.device, self.dtype), rec.to(self.device)))
            else:
                attn = layer.self_attn
                shape = (num_slots, attn.num_kv_heads, capacity, attn.head_dim)
                kv = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2)]
                layers.append(AttentionCache(*kv))
        return SlotState(torch.zeros(num_slots, dtype=torch.long, device=self.device), layers)

    # ---- prefill -----------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(
        self,
        prompts: Sequence[Sequence[int]],
        state: SlotState,
        slots: Sequence[int],
        starts: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Run the prompts packed in one row (cu_seqlens) and write their state into `slots`.

        Args:
            prompts: N non-empty token-id lists.
            state: the slots' state; slots: N distinct slot indices the prompts take.
            starts: tokens each slot already holds (default none: fresh slots). A prompt with a start
                > 0 continues its slot from there (a long prompt prefilled in chunks: the chunk's
                attention reads the slot's cached keys, its conv and GDN state continue the slot's).
        Returns:
            logits [N, VOCAB] at each prompt's last token.
        Raises:
            ValueError: no prompts, an empty prompt or one past the state's capacity, a token id
                outside the vocabulary, slots that are not N distinct indices of the state, or bad starts.
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prefill needs at least one prompt, each with at least one token")
        S = state.num_slots
        if len(slots) != len(prompts) or len(set(slots)) != len(slots) or not all(0 <= s < S for s in slots):
            raise ValueError(f"slots must be {len(prompts)} distinct indices below {S}, got {list(slots)}")
        starts = [0] * len(prompts) if starts is None else [int(s) for s in starts]
        if len(starts) != len(prompts) or min(starts) < 0:
            raise ValueError(f"starts must be {len(prompts)} non-negative token counts, got {starts}")
        longest, capacity = max(s + len(p) for s, p in zip(starts, prompts)), state.capacity
        if capacity is not None and longest > capacity:
            raise ValueError(f"prompt of {longest} tokens exceeds the slots' capacity of {capacity} positions")
        device = self.device
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
        if ids.min() < 0 or ids.max() >= self.arch.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.arch.vocab_size}), got {ids.min()}..{ids.max()}")
        cu = torch.zeros(len(prompts) + 1, dtype=torch.int32)
        cu[1:] = lengths.cumsum(0)
        cu_cpu = cu.tolist()  # the offsets as host ints: the ops read none back from the device
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths.tolist())])
        slot_index = torch.tensor(list(slots), dtype=torch.long, device=device)
        token_slot = slot_index.repeat_interleave(lengths.to(device))  # [T] the slot of each token
        token_pos = positions.to(device)
        ids, positions, cu = ids[None].to(device), positions[None].to(device), cu.to(device)
        fresh = not any(starts)

        text = self.model.model
        hidden = text.embed_tokens(ids)
        cos, sin = text.rotary(positions, hidden.dtype)
        caches = iter(state.layers)

        def mixer(layer, x):
            cache = next(caches)
            if layer.layer_type == "linear_attention":
                return self._gdn_prefill(
                    layer.linear_attn, x, (cu, cu_cpu), cache, slot_index, None if fresh else starts
                )
            if fresh:
                return self._attention_prefill(layer.self_attn, x, cos, sin, (cu, cu_cpu), cache, token_slot, token_pos)
            chunks = list(zip(slots, starts))
            return self._attention_continue(layer.self_attn, x, cos, sin, cu_cpu, cache, token_slot, token_pos, chunks)

        hidden, residual = self._layers(hidden, mixer)
        state.lengths[slot_index] = lengths.to(device) + torch.tensor(starts, device=device)
        last = cu[1:].long() - 1  # each prompt's last token
        return self._logits(hidden[0, last], residual[0, last])

    def _attention_prefill(self, attn: Attention, x, cos, sin, offsets, cache: AttentionCache, token_slot, token_pos):
        q, k, v, gate = self._attention_qkv(attn, x, cos, sin)
        cu, cu_cpu = offsets
        o = attn.ops.attention(q, k, v, scale=attn.head_dim**-0.5, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
        cache.k[token_slot, :, token_pos] = k[0]
        cache.v[token_slot, :, token_pos] = v[0]
        return self._attention_out(attn, o, gate)

    def _attention_continue(
        self, attn: Attention, x, cos, sin, cu_cpu, cache: AttentionCache, token_slot, token_pos, chunks
    ):
        """Chunks that continue their slots (chunks: (slot, start) per prompt): each chunk's queries
        attend to its slot's cached keys and to its own causally, one SDPA per chunk (the grouped heads
        as query rows, as in `_attention_step`)."""
        q, k, v, gate = self._attention_qkv(attn, x, cos, sin)
        cache.k[token_slot, :, token_pos] = k[0]
        cache.v[token_slot, :, token_pos] = v[0]
        HKV, group, K = attn.num_kv_heads, attn.num_heads // attn.num_kv_heads, attn.head_dim
        outs = []
        for n, (slot, start) in enumerate(chunks):
            a, b = cu_cpu[n], cu_cpu[n + 1]
            end = start + b - a
            qg = q[0, a:b].transpose(0, 1).reshape(HKV, group * (b - a), K)  # rows: (head in group, token)
            query_pos = start + torch.arange(b - a, device=x.device).repeat(group)
            visible = torch.arange(end, device=x.device)[None, :] <= query_pos[:, None]
            o = F.scaled_dot_product_attention(
                qg, cache.k[slot, :, :end], cache.v[slot, :, :end], attn_mask=visible, scale=K**-0.5
            )  # [HKV, group * T_n, V]
            outs.append(o.reshape(attn.num_heads, b - a, -1).transpose(0, 1))
        return self._attention_out(attn, torch.cat(outs)[None], gate)

    def _gdn_prefill(self, gdn: GatedDeltaNet, x, offsets, cache: LinearCache, slot_index, starts=None):
        """The GatedDeltaNet mixer over packed prompts, from fresh slots or (starts given) continuing each
        slot's conv and recurrent state: the conv runs over each chunk with its slot's last W-1 inputs
        in front (zeros for a fresh slot), and the chunked rule starts from its slot's state."""
        B, T, _ = x.shape
        cu, cu_cpu = offsets
        mixed_qkv = gdn.in_proj_qkv(x)
        conv_weight = gdn.conv1d.weight.squeeze(1)
        initial_state = None
        if starts is not None:
            W1, N = conv_weight.shape[1] - 1, len(starts)
            continued = torch.tensor(starts, device=x.device)[:, None, None] > 0
            before = torch.where(continued, cache.conv[slot_index], 0).transpose(1, 2)  # [N, W-1, C]
            pieces = [t for n in range(N) for t in (before[n], mixed_qkv[0, cu_cpu[n] : cu_cpu[n + 1]])]
            mixed_qkv = torch.cat(pieces)[None]  # each chunk with its W-1 inputs in front
            cu_cpu = [c + W1 * n for n, c in enumerate(cu_cpu)]
            cu = torch.tensor(cu_cpu, dtype=torch.int32, device=x.device)
            keep = torch.cat([torch.arange(a + W1, b) for a, b in zip(cu_cpu[:-1], cu_cpu[1:])]).to(x.device)
            initial_state = torch.where(continued[..., None], cache.recurrent[slot_index], 0)
        cache.conv[slot_index] = conv1d_state_from_prefill(mixed_qkv, conv_weight.shape[1], cu, cu_seqlens_cpu=cu_cpu)
        qkv = gdn.ops.conv1d(mixed_qkv, conv_weight, None, activation="silu", cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
        if starts is not None:  # back to the chunks' own tokens and offsets
            qkv, cu_cpu = qkv[:, keep], offsets[1]
            cu = offsets[0]
        q, k, v = self._split_qkv(gdn, qkv)
        g, beta = self._gates(gdn, gdn.in_proj_a(x), gdn.in_proj_b(x))
        o, final = gdn.ops.gdn(
            q,
            k,
            v,
            g,
            beta,
            scale=None,
            initial_state=initial_state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu,
            cu_seqlens_cpu=cu_cpu,
        )
        cache.recurrent[slot_index] = final.to(self._state_dtype)
        z = gdn.in_proj_z(x).reshape(B, T, gdn.num_v_heads, gdn.head_v_dim)
        o = gdn.norm(o, gate=z)
        return gdn.out_proj(o.reshape(B, T, gdn.value_dim))

    # ---- one token ---------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, state: SlotState, active: torch.Tensor | None = None) -> torch.Tensor:
        """Feed one token to each of slots [0, B); returns logits [B, VOCAB]. Active slots advance in
        place (KV written at their length, states stepped, length + 1); inactive ones are left
        exactly as they were (their logits are undefined). No value is read back to the host.

        Args:
            tokens: [B] int token ids on the model's device, B <= the state's slots.
            active: [B] bool, default all.
        Raises:
            ValueError: tokens not [B] with B <= slots, or active not [B] bool.
        """
        B = tokens.numel()
        if tokens.dim() != 1 or not 0 < B <= state.num_slots:
            raise ValueError(f"tokens must be [B] with 0 < B <= {state.num_slots} slots, got {tuple(tokens.shape)}")
        if active is None:
            active = torch.ones(B, dtype=torch.bool, device=self.device)
        elif active.dtype != torch.bool or tuple(active.shape) != (B,):
            raise ValueError(f"active must be a [{B}] bool tensor, got {tuple(active.shape)} {active.dtype}")
        text = self.model.model
        lengths = state.lengths[:B]
        hidden = text.embed_tokens(tokens[:, None])  # [B, 1, D]
        cos, sin = text.rotary(lengths[:, None], hidden.dtype)
        slots = self._kv_positions(lengths, state.capacity) if state.capacity is not None else None
        caches = iter(state.layers)

        def mixer(layer, x):
            if layer.layer_type == "linear_attention":
                return self._gdn_step(layer.linear_attn, x, next(caches), active)
            return self._attention_step(layer.self_attn, x, cos, sin, next(caches), slots, active)

        hidden, residual = self._layers(hidden, mixer)
        lengths += active
        return self._logits(hidden[:, 0], residual[:, 0])

    @staticmethod
    def _kv_positions(lengths: torch.Tensor, capacity: int):
        """What every attention layer of a step indexes its cache with, computed once per step: (rows
        [B], the position each row writes [B], how many positions each row attends to [B])."""
        rows = torch.arange(lengths.numel(), device=lengths.device)
        at = lengths.clamp(max=capacity - 1)  # an idle slot may sit at capacity; it writes back what is there
        return rows, at, at + 1

    def _attention_step(self, attn: Attention, x, cos, sin, cache: AttentionCache, slots, active):
        q, k, v, gate = self._attention_qkv(attn, x, cos, sin)  # [B, 1, H | HKV, K]
        B = x.shape[0]
        rows, at, counts = slots
        keep = active[:, None, None]
        cache.k[rows, :, at] = torch.where(keep, k[:, 0], cache.k[rows, :, at])
        cache.v[rows, :, at] = torch.where(keep, v[:, 0], cache.v[rows, :, at])
        o = self.decode_attention(q[:, 0], cache.k, cache.v, counts, attn.head_dim**-0.5)  # [B, H, V]
        return self._attention_out(attn, o.reshape(B, 1, attn.num_heads, -1), gate)

    def _gdn_step(self, gdn: GatedDeltaNet, x, cache: LinearCache, active):
        B = x.shape[0]
        x = x[:, 0]  # [B, D]
        conv_weight = gdn.conv1d.weight.squeeze(1)
        qkv, _ = self.conv_step(
            gdn.in_proj_qkv(x), cache.conv[:B], conv_weight, None, activation="silu", active=active, inplace=True
        )
        q, k, v = self._split_qkv(gdn, qkv[:, None])
        g, beta = self._gates(gdn, gdn.in_proj_a(x), gdn.in_proj_b(x))
        o, _ = self.gdn_step(
            q[:, 0],
            k[:, 0],
            v[:, 0],
            g,
            beta,
            cache.recurrent[:B],
            use_qk_l2norm_in_kernel=True,
            active=active,
            inplace=True,
        )
        o = gdn.norm(o, gate=gdn.in_proj_z(x).reshape(B, gdn.num_v_heads, gdn.head_v_dim))
        return gdn.out_proj(o.reshape(B, 1, gdn.value_dim))

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


class StepGraphs:
    """`MoeDecoder.step` (and what the caller does with its logits) captured once per (batch size,
    key, state version) as a device graph (CUDA graphs, or torch_npu's NPUGraph), replayed on the
    same input buffers: a decode step then costs one launch of host time instead of a few hundred.

    The caller keeps `tokens` and `active` in persistent buffers (their slices [0, B) are what a
    graph reads) and consumes the returned outputs before the next call (the graphs share one memory
    pool, so their outputs may alias). Capturing runs the step twice eagerly first (kernel
    selection and autotuning happen there, not in the graph) with every slot inactive, so capturing
    at any time leaves the slots as they were.
    """

    def __init__(self, decoder: MoeDecoder):
        module = device.device_module()
        graph_class = getattr(module, "CUDAGraph", None) or getattr(module, "NPUGraph", None)
        if graph_class is None or not device.is_accelerator(decoder.device):
            raise ValueError(f"device graphs need a cuda or npu model, got {decoder.device}")
        self.decoder, self.module, self.graph_class = decoder, module, graph_class
        self.graphs: dict[tuple, tuple] = {}  # (B, key) -> (graph, outputs)
        self.version: int | None = None
        self.pool = None

    def step(self, tokens: torch.Tensor, state: SlotState, active: torch.Tensor, then=None, key=None):
        """As `MoeDecoder.step(tokens, state, active)`, or `then(logits)` of it, through the graph
        captured for (len(tokens), key). `then` runs inside the graph: it may only read and write
        tensors that outlive the graph, must leave inactive rows as they are, and is captured once
        per key: the caller gives a new key (or calls `clear`) when what it would do changes."""
        if state.version != self.version:  # reallocated tensors: the old graphs read freed memory
            self.clear()
            self.version = state.version
        index = (tokens.numel(), key)
        if index not in self.graphs:
            self.graphs[index] = self._capture(tokens, state, active, then)
        graph, outputs = self.graphs[index]
        graph.replay()
        return outputs

    def clear(self) -> None:
        """Forget every graph (the tensors a `then` reads were reallocated) and their memory pool: the
        allocator retires a pool whose graphs are all gone, and a capture into it then fails (CUDA:
        "use_count > 0 INTERNAL ASSERT FAILED"); the next capture opens a new one."""
        self.graphs, self.pool = {}, None

    def _capture(self, tokens, state, active, then):
        def run():
            logits = self.decoder.step(tokens, state, active)
            return logits if then is None else then(logits)

        saved = active.clone()
        active.zero_()
        stream = self.module.Stream()
        stream.wait_stream(self.module.current_stream())
        with self.module.stream(stream):
            for _ in range(2):
                run()
        self.module.current_stream().wait_stream(stream)
        if self.pool is None:
            self.pool = self.module.graph_pool_handle()
        graph = self.graph_class()
        with self.module.graph(graph, pool=self.pool):
            outputs = run()
        active.copy_(saved)
        return graph, outputs


__all__ = ["AttentionCache", "LinearCache", "MoeDecoder", "SlotState", "StepGraphs"]
