"""Decoding pieces for speculative decoding with Qwen3.5's MTP layer: the MTP layer's own KV cache and its
forward over slots (the main model over several new tokens per slot, with every token's hidden state, is
`MoeDecoder.verify` and `commit`).

- `MtpDrafter`: the MTP module's depth-1 step over slots. Its layer is a full-attention decoder layer, so its
  decode state is one KV cache [S, HKV, L, K] (`AttentionCache`). Position s of a slot holds the layer's
  keys and values for the input (main hidden state at s, embedding of token s+1), as the trainer's
  `MoeCausalLM.mtp_hidden_states` computes them; `forward` (packed chunks, a prompt) and `step` (fixed-shape
  rows of device tensors, a speculative round) write the given positions and return the layer's normed
  output there (its logits predict token s+2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..ops.device import to_device
from ..ops.varlen import offsets_tensor
from .decode import AttentionCache, MoeDecoder


def _packed(chunks: Sequence[Sequence[int]], starts: Sequence[int], device: torch.device):
    """ids [1, T], positions [1, T], (cu [N+1] int32 on device, its host ints), token_pos [T] of chunks
    that continue from `starts`."""
    lengths = [len(c) for c in chunks]
    cu_cpu = [0]
    for n in lengths:
        cu_cpu.append(cu_cpu[-1] + n)
    ids = to_device(torch.tensor([t for c in chunks for t in c], dtype=torch.long), device)
    positions = to_device(torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)]), device)
    cu = offsets_tensor(cu_cpu, device)
    return ids[None], positions[None], (cu, cu_cpu), positions


@dataclass
class MtpCache:
    """The MTP layer's KV cache of S slots: k, v [S, HKV, L, K] in the model dtype."""

    attention: AttentionCache

    @property
    def capacity(self) -> int:
        return self.attention.k.shape[2]


class MtpDrafter:
    """The MTP module's first depth, one decode step per call, over slots of its own KV cache.

    Drafting several tokens repeats this depth (vLLM's rule for Qwen3.5's one MTP layer: depth i uses
    layer (i - 1) mod n): the layer's output at s stands in for the main hidden state at s + 1. Further MTP
    layers of a checkpoint are not used.
    """

    def __init__(self, decoder: MoeDecoder):
        mtp = getattr(decoder.model, "mtp", None)
        if mtp is None:
            raise ValueError(f"{decoder.arch.mtp_num_hidden_layers=}: speculative decoding needs the MTP layer")
        self.decoder, self.mtp = decoder, mtp
        self.layer = mtp.layers[0]

    def allocate(self, num_slots: int, capacity: int) -> MtpCache:
        attn = self.layer.self_attn
        shape = (num_slots, attn.num_kv_heads, capacity, attn.head_dim)
        kv = [torch.zeros(shape, dtype=self.decoder.dtype, device=self.decoder.device) for _ in range(2)]
        return MtpCache(AttentionCache(*kv))

    @torch.no_grad()
    def forward(
        self,
        hidden: torch.Tensor,
        tokens: Sequence[Sequence[int]],
        cache: MtpCache,
        slots: Sequence[int],
        starts: Sequence[int],
    ) -> torch.Tensor:
        """Run the MTP layer at positions starts[n] .. starts[n] + len(tokens[n]) - 1 of each slot.

        Args:
            hidden: [T, D] per position s, the main model's final hidden state at s (or, drafting further,
                the MTP output at s - 1), chunks packed in order.
            tokens: N lists, per position s the token s + 1 (the token sampled or drafted after s).
            cache: the MTP KV cache; its positions below starts[n] must hold slot slots[n]'s earlier ones.
            slots, starts: per chunk, its slot and first position.
        Returns:
            [T, D] the MTP layer's normed output at each position (logits: `MoeCausalLM.logits`).
        """
        device = self.decoder.device
        if cache.capacity < max(s + len(t) for s, t in zip(starts, tokens)):
            raise ValueError(f"MTP positions past the cache's capacity of {cache.capacity}")
        ids, positions, offsets, token_pos = _packed(tokens, starts, device)
        token_slot = to_device(torch.tensor([s for s, t in zip(slots, tokens) for _ in t], dtype=torch.long), device)
        chunks = list(zip(slots, starts))

        def attend(x, cos, sin):
            return self.layer.self_attn.prefill(x, cos, sin, offsets, cache.attention, token_slot, token_pos, chunks)

        return self._depth(ids, positions, hidden[None], attend)[0]

    def step(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: MtpCache,
        slots: torch.Tensor,
        active: torch.Tensor,
    ) -> torch.Tensor:
        """`forward` at T positions per row, from device tensors and reading nothing back (a speculative round's
        catch-up, T = k + 1, and its draft steps, T = 1): hidden [B, T, D], tokens, positions [B, T] int64 (row
        b's inputs and their positions, in order), slots [B] int64 (row b's slot), active [B] or [B, T] bool
        (what is not active writes nothing to the cache; its output is undefined). Returns [B, T, D]."""

        def attend(x, cos, sin):
            return self.layer.self_attn.step_positions(x, cos, sin, cache.attention, positions, active, slots)

        return self._depth(tokens, positions, hidden, attend)

    def _depth(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, attend) -> torch.Tensor:
        """`MultiTokenPredictor.forward`'s depth (the same ops in the same order) with `attend(x, cos, sin)`, the
        attention reading and writing the cache, in place of the layer's attention: ids, positions [B, T] and
        hidden [B, T, D] -> the normed output [B, T, D]."""
        text, mtp, layer = self.decoder.model.model, self.mtp, self.layer
        embeds = text.embed_tokens(ids)
        cos, sin = text.rotary(positions, embeds.dtype)
        residual = mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(embeds), mtp.pre_fc_norm_hidden(hidden)], dim=-1))
        x, residual = layer.post_attention_layernorm(
            attend(layer.input_layernorm(residual), cos, sin), residual=residual
        )
        x, _ = layer.mlp(x)
        return mtp.norm(x, residual=residual)[0]


__all__ = ["MtpCache", "MtpDrafter"]
