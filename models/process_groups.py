"""The process groups a model is split over, one type per kind of parallelism.

Engines build them from their meshes (`engines/fsdp2.py`, `engines/veomni.py`) and hand them to the
model (`MoeCausalLM.set_sequence_parallel`, `set_expert_parallel`); which submodules use them and how
their parameters shard is `models/fsdp_plan.py`. The ops take a group by duck type (`group`, `size`,
`rank`; `weight_grad_scale` for the experts), so they need nothing from here.

- `UlyssesGroup`: Ulysses sequence parallelism. Each rank of an SP group of size `sp` holds T/sp
  tokens of the packed row (padded to a multiple of `sp`; the pad forms one trailing sequence in
  `cu_seqlens`). Token-wise layers (norms, MoE, projections) run on the local tokens. A token mixer
  needs whole sequences, so it trades tokens for heads around its sequence op:

    attention:  q, k, v [B, T/sp, H, K] --seq_to_heads--> [B, T, H/sp, K]
                (kv heads fewer than sp are first repeated: `expand_kv_heads`)
                o [B, T, H/sp, K] --heads_to_seq--> [B, T/sp, H, K] -> output gate, o_proj
    GatedDeltaNet: in_proj_qkv(x) [B, T/sp, C] is split into q | k | v head groups, each goes
                seq_to_heads; rank r keeps key heads `head_slice(H)` and value heads
                `head_slice(HV)` (contiguous, so value head j still reads key head j // (HV/H)),
                with the matching rows of conv1d.weight, A_log and dt_bias; beta / g / z follow
                their value heads; the output goes heads_to_seq before out_proj.

  The per-rank parameter slices are views of the unsharded parameters inside the FSDP unit, so
  gradients land in the right rows. The engine side (slicing a packed row, gathering per-token
  results) is `engines/batch.py` and `engines/logprob_model.py`.
- `ExpertParallelGroup`: expert parallelism; each rank holds E / size routed experts
  (`ops/experts/expert_parallel.py` moves the token copies).

Alphabet: B batch (1 when packed), T tokens, H heads, K head dim, C channels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_gather_tensor_autograd, all_to_all_single_autograd


@dataclass(frozen=True)
class UlyssesGroup:
    """One sequence-parallel group: `size` ranks, this process being `rank` within `group`."""

    group: dist.ProcessGroup
    size: int
    rank: int

    def head_slice(self, num_heads: int) -> slice:
        """The heads this rank computes after `seq_to_heads`. Raises ValueError unless size divides them."""
        if num_heads % self.size:
            raise ValueError(f"{num_heads} heads do not split over sequence-parallel size {self.size}")
        per_rank = num_heads // self.size
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)

    def expand_kv_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, HKV, K] -> [B, T, max(HKV, size), K]: each kv head repeated size / HKV times when
        HKV < size, so every rank receives the kv head its query heads read."""
        kv = x.shape[2]
        if kv % self.size == 0:
            return x
        if self.size % kv:
            raise ValueError(f"{kv} kv heads neither divide nor are divided by sequence-parallel size {self.size}")
        return x.repeat_interleave(self.size // kv, dim=2)

    def seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T/size, H, ...] -> [B, T, H/size, ...] (all-to-all; differentiable)."""
        B, t, H = x.shape[:3]
        rest = x.shape[3:]
        if H % self.size:
            raise ValueError(f"{H} heads do not split over sequence-parallel size {self.size}")
        # [size (destination), B, t, H/size, ...]: chunk j of the heads goes to rank j
        send = x.reshape(B, t, self.size, H // self.size, *rest).movedim(2, 0).contiguous()
        received = all_to_all_single_autograd(send, None, None, self.group)
        # received[j] = rank j's tokens for my heads: tokens in rank order
        return received.movedim(0, 1).reshape(B, self.size * t, H // self.size, *rest)

    def seq_to_heads_many(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Several [B, T/size, H_i, ...] tensors of one dtype -> [B, T, H_i/size, ...] each, in one
        all-to-all (one collective per token mixer instead of one per tensor)."""
        B, t = xs[0].shape[:2]
        for x in xs:
            if x.shape[:2] != (B, t) or x.dtype != xs[0].dtype:
                raise ValueError(f"tensors to exchange must share [B, T/size] and dtype, got {[x.shape for x in xs]}")
            if x.shape[2] % self.size:
                raise ValueError(f"{x.shape[2]} heads do not split over sequence-parallel size {self.size}")
        # chunk j of every tensor's heads, side by side, is what rank j receives
        received = self.seq_to_heads(torch.cat([x.reshape(B, t, self.size, -1) for x in xs], dim=-1))
        widths = [x[0, 0].numel() // self.size for x in xs]
        return tuple(
            part.reshape(B, t * self.size, x.shape[2] // self.size, *x.shape[3:])
            for part, x in zip(received.split(widths, dim=-1), xs)
        )

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H/size, ...] -> [B, T/size, H, ...] (the inverse all-to-all; differentiable)."""
        B, T, h = x.shape[:3]
        rest = x.shape[3:]
        t = T // self.size
        send = x.reshape(B, self.size, t, h, *rest).movedim(1, 0).contiguous()
        received = all_to_all_single_autograd(send, None, None, self.group)
        return received.movedim(0, 2).reshape(B, t, self.size * h, *rest)

    def gather_tokens(self, x: torch.Tensor, pad: int) -> torch.Tensor:
        """[T/size, ...] per rank -> [T - pad, ...] on every rank. The backward sums the gradient of
        every rank (each computes the same loss), which with FSDP's average over dp x sp ranks
        gives exactly the data-parallel gradient."""
        # functional collectives: torch.distributed.nn's gather backward scatters from global
        # rank 0, which fails on gloo for a group without rank 0
        full = all_gather_tensor_autograd(x.contiguous(), 0, self.group)
        # clone (not a view): a plain tensor, not the collective's async wrapper (nested tensors refuse it)
        return full[: full.shape[0] - pad].clone()


@dataclass(frozen=True)
class ExpertParallelGroup:
    """The process group over which experts are split, this rank's index in it, and its size.

    `weight_grad_scale` multiplies the gradients of the local expert weights in backward: an
    expert's gradient sums the tokens of every rank of the group, so an engine whose gradient
    reduction averages over the other ranks only (FSDP over the expert-sharding mesh) sets
    1 / size to get the same data-parallel average as every other weight.
    """

    group: dist.ProcessGroup
    size: int
    rank: int
    weight_grad_scale: float = 1.0
