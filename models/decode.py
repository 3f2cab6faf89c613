"""Incremental decoding over the module tree of `MoeCausalLM` into fixed decode slots: prefill
prompts into free slots, then advance the slots one token per step. The rollout's generation path.

The decoder walks the model's own layers with its weights and resolved ops, so it computes what
`MoeCausalLM.forward` computes; each token mixer's decode form, which keeps state, is the mixer's own
(`Attention.prefill` / `.step`, `GatedDeltaNet.prefill` / `.step`: one definition of the projections,
gates and state update for both paths). The state (`SlotState`) is allocated once for S slots:

- full attention: a KV cache [S, HKV, L, K] per layer (k after k_norm and rope), L the capacity;
  a step writes position `lengths[s]` and attends to the positions `<= lengths[s]` of its slot
  (`attention.decode`);
- GatedDeltaNet: the conv state [S, C, W-1] (last W-1 conv inputs, `ops/conv1d/step.py`) and the
  recurrent state [S, HV, K, V] in fp32 (`ops/gdn/step.py`), stepped in place.

A step runs slots [0, B) with an `active` mask: inactive slots (free, or finished since the caller
last looked) keep their state and length exactly, so one step of fixed shape serves any mix of
running and idle slots, reads no lengths on the host and can be captured once as a device graph
(the rollout's `engines/rollout/graphs.py`). Positions continue from the prompt (text: one row; mRoPE
models get three identical rows). The model must be local: no sequence or expert parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..ops.device import to_device
from .causal_lm import MoeCausalLM
from .layers import Experts, join_projections


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
        src_t, dst_t = to_device(torch.tensor([list(src), list(dst)], dtype=torch.long), self.lengths.device)
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
    tokens for slots [0, B) (the active slots advance in place). Logits as `MoeCausalLM.logits` gives
    them. Each token mixer's prefill and step are its own (`Attention.prefill` / `.step`,
    `GatedDeltaNet.prefill` / `.step`), on the ops the model resolved at build.

    The decoder joins each layer's projections of one input into one weight tensor (`join_projections`;
    the parameters stay, as views of it): a decode step then runs one product per input instead of up to
    four narrow ones. An optimizer of the model must be made after the decoder.
    """

    def __init__(self, model: MoeCausalLM):
        if model.sequence_parallel is not None:
            raise ValueError("decoding needs a model without sequence parallelism")
        if any(isinstance(m, Experts) and m.expert_parallel is not None for m in model.modules()):
            raise ValueError("decoding needs a model without expert parallelism")
        join_projections(model)
        self.model = model
        self.arch = model.arch
        self.dtype = next(model.parameters()).dtype
        self.device = model.lm_head.weight.device

    # ---- the slots -----------------------------------------------------------------------------

    def allocate(self, num_slots: int, capacity: int) -> SlotState:
        """Zeroed state for `num_slots` slots of `capacity` KV positions each."""
        if num_slots < 1 or capacity < 1:
            raise ValueError(f"need at least one slot and one position, got {num_slots} x {capacity}")
        layers = []
        for layer in self.model.model.layers:
            if layer.layer_type == "linear_attention":
                gdn = layer.linear_attn
                # zeroed where they live: a host buffer copied over would cost a rollout waking from sleep
                # (hundreds of MB of recurrent state per layer at 256 slots) a host fill and a transfer
                conv_shape = (num_slots, gdn.conv1d.weight.shape[0], gdn.conv1d.weight.shape[-1] - 1)
                conv = torch.zeros(conv_shape, dtype=self.dtype, device=self.device)
                rec_shape = (num_slots, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim)
                rec = torch.zeros(rec_shape, dtype=self._state_dtype, device=self.device)
                layers.append(LinearCache(conv, rec))
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
        hidden, residual, cu = self._walk(prompts, state, slots, starts)
        last = cu[1:].long() - 1  # each prompt's last token
        return self._logits(hidden[last], residual[last])

    def _walk(self, prompts, state: SlotState, slots, starts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`prefill`'s checks and layer walk: (hidden [T, D] before the final norm, its residual, cu [N+1])."""
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
        slot_index = to_device(torch.tensor(list(slots), dtype=torch.long), device)
        token_slot = to_device(torch.tensor(list(slots), dtype=torch.long).repeat_interleave(lengths), device)
        token_pos = to_device(positions, device)  # [T] the slot and position of each token
        ids, positions, cu = to_device(ids, device)[None], token_pos[None], to_device(cu, device)
        fresh = not any(starts)

        text = self.model.model
        hidden = text.embed_tokens(ids)
        cos, sin = text.rotary(positions, hidden.dtype)
        caches = iter(state.layers)

        def mixer(layer, x):
            cache = next(caches)
            if layer.layer_type == "linear_attention":
                return layer.linear_attn.prefill(x, (cu, cu_cpu), cache, slot_index, None if fresh else starts)
            chunks = None if fresh else list(zip(slots, starts))
            return layer.self_attn.prefill(x, cos, sin, (cu, cu_cpu), cache, token_slot, token_pos, chunks)

        hidden, residual = self._layers(hidden, mixer)
        state.lengths[slot_index] = to_device(lengths + torch.tensor(starts, dtype=torch.long), device)
        return hidden[0], residual[0], cu

    @torch.no_grad()
    def extend(self, chunks: Sequence[Sequence[int]], state: SlotState, slots: Sequence[int]) -> torch.Tensor:
        """Feed each slot its chunk of tokens from the slot's length on (a fresh slot takes its prompt), as
        `prefill` with the slots' lengths as starts; returns the final normed hidden state [T, D] of every fed
        token, chunks packed in order (`MoeCausalLM.logits` of it: every position's logits, what verifying
        drafted tokens needs)."""
        starts = state.lengths[to_device(torch.tensor(list(slots), dtype=torch.long), self.device)].tolist()
        hidden, residual, _ = self._walk(chunks, state, slots, starts)
        return self.model.model.norm(hidden, residual=residual)[0]

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
        slots = self._kv_positions(lengths, state.capacity, active) if state.capacity is not None else None
        caches = iter(state.layers)

        def mixer(layer, x):
            if layer.layer_type == "linear_attention":
                return layer.linear_attn.step(x, next(caches), active)
            return layer.self_attn.step(x, cos, sin, next(caches), slots, active)

        hidden, residual = self._layers(hidden, mixer)
        lengths += active
        return self._logits(hidden[:, 0], residual[:, 0])

    # ---- several tokens (speculative decoding's verification) ----------------------------------

    @torch.no_grad()
    def verify(self, tokens: torch.Tensor, state: SlotState, active: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Feed T tokens to each of slots [0, B) at positions length .. length + T - 1 without advancing the
        slots: the attention layers write those positions' keys and values (a position at or past a slot's
        length is never read), the GatedDeltaNet layers step through the slots' states without writing them
        (one launch per op for all T positions). No value is read back to the host and the shapes depend on (B, T)
        only.

        Args:
            tokens: [B, T] int token ids on the model's device; active: [B] bool (inactive rows: nothing written).
        Returns:
            (the final normed hidden state [B, T, D] of every position, what `commit` takes).
        """
        B, T = tokens.shape
        text = self.model.model
        positions = state.lengths[:B, None] + torch.arange(T, device=self.device)
        hidden = text.embed_tokens(tokens)
        cos, sin = text.rotary(positions, hidden.dtype)
        caches, steps = iter(state.layers), []
        counts = torch.where(active, T, 0)  # the positions each slot's GatedDeltaNet states step through

        def mixer(layer, x):
            if layer.layer_type == "linear_attention":
                out, inputs = layer.linear_attn.step_positions(x, next(caches), counts)
                steps.append(inputs)
                return out
            return layer.self_attn.step_positions(x, cos, sin, next(caches), positions, active)

        hidden, residual = self._layers(hidden, mixer)
        return text.norm(hidden, residual=residual)[0], steps

    @torch.no_grad()
    def commit(self, steps: list, kept: torch.Tensor, state: SlotState, active: torch.Tensor) -> None:
        """Advance the active slots of [0, B) by kept[b] ([B] int64 on the device) of the positions `verify`
        fed them: the GatedDeltaNet layers step the slots' states through those positions by the steps
        `verify` took (bitwise the same), and the lengths grow by kept. No value is read back to the host."""
        linear = [layer for layer in self.model.model.layers if layer.layer_type == "linear_attention"]
        caches = [cache for cache in state.layers if isinstance(cache, LinearCache)]
        kept = torch.where(active, kept, 0)
        for layer, cache, inputs in zip(linear, caches, steps, strict=True):
            layer.linear_attn.advance_positions(inputs, cache, kept)
        state.lengths[: kept.numel()] += kept

    @staticmethod
    def _kv_positions(lengths: torch.Tensor, capacity: int, active: torch.Tensor):
        """What every attention layer of a step indexes its cache with, computed once per step: (rows
        [B], the position each row writes [B], how many positions each row attends to [B]: one for an idle
        row, whose output is not used, so a step reads the caches of the running requests only)."""
        rows = torch.arange(lengths.numel(), device=lengths.device)
        at = lengths.clamp(max=capacity - 1)  # an idle slot may sit at capacity; it writes back what is there
        return rows, at, torch.where(active, at + 1, 1)

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
        """Final norm of residual + hidden, then the LM head (`MoeCausalLM.logits`)."""
        return self.model.logits(self.model.model.norm(hidden, residual=residual)[0])

    @property
    def _state_dtype(self) -> torch.dtype:
        return torch.float64 if self.dtype == torch.float64 else torch.float32


__all__ = ["AttentionCache", "LinearCache", "MoeDecoder", "SlotState"]
