"""Qwen3.5-MoE's own layer: the GatedDeltaNet linear attention. Everything else of the model
(full attention with output gate, MoE with shared expert, decoder) is in `models/layers.py` and
`models/causal_lm.py`, shared with Qwen3-MoE.

Per token: q|k|v = silu(causal_conv1d(in_proj_qkv(x))), split into H query/key heads of K and
HV value heads of V; beta = sigmoid(in_proj_b(x)); g = -exp(A_log) * softplus(in_proj_a(x) +
dt_bias) (fp32); o = gated_delta_rule(q, k, v, g, beta) with q/k l2-normalised; then the gated
RMSNorm with z = in_proj_z(x) and out_proj.

Under Ulysses sequence parallelism (`MoeCausalLM.set_sequence_parallel`) the projections run on
this rank's tokens, one all-to-all hands each rank whole sequences of a block of key and value
heads, and the conv, the recurrence and the gated norm run there on the matching slices of
conv1d.weight, A_log and dt_bias (see `verl_moe.models.process_groups`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...ops.conv1d.step import conv1d_state_from_prefill
from ...ops.device import to_device
from ...ops.varlen import HostOffsets, host_values, offsets_tensor
from ..arch import ArchConfig
from ..layers import Linear, ResolvedOps, RMSNorm, project_jointly

if TYPE_CHECKING:
    from ..process_groups import UlyssesGroup


@dataclass(frozen=True)
class TileSpan:
    """Tokens [start, stop) of a packed row of sequences, as one tile of the GatedDeltaNet: the conv also
    reads the `prefix` tokens before `start` that belong to the same sequence (its context), offsets
    local to the prefixed tile (`conv_cu`) and to the tile (`gdn_cu`); `continues`: the tile's first
    sequence began before it (its state carries in); `carries_on`: its last one goes on after it."""

    start: int
    stop: int
    prefix: int
    conv_cu: tuple[int, ...]
    gdn_cu: tuple[int, ...]
    continues: bool
    carries_on: bool

    @property
    def sequences(self) -> int:
        return len(self.gdn_cu) - 1


def tile_span(bounds: list[int], start: int, stop: int, context: int) -> TileSpan:
    """The tile [start, stop) of a row whose sequences are `bounds` (cu_seqlens as host ints), with up to
    `context` tokens of conv context (kernel width - 1) from the sequence running into it."""
    first = bounds[bisect.bisect_right(bounds, start) - 1]  # start of the sequence holding `start`
    prefix = start - max(first, start - context)
    inner = [b for b in bounds if start < b < stop]
    return TileSpan(
        start=start,
        stop=stop,
        prefix=prefix,
        conv_cu=(0, *(b - start + prefix for b in inner), stop - start + prefix),
        gdn_cu=(0, *(b - start for b in inner), stop - start),
        continues=first < start,
        carries_on=stop not in bounds,
    )


class GatedDeltaNet(nn.Module):
    """Linear-attention token mixer; parameter names equal transformers' `Qwen3_5MoeGatedDeltaNet`."""

    joint_projections = (("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),)

    def __init__(self, arch: ArchConfig, ops: ResolvedOps, factory: dict):
        super().__init__()
        D = arch.hidden_size
        self.num_k_heads, self.num_v_heads = arch.linear_num_key_heads, arch.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = arch.linear_key_head_dim, arch.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        conv_dim = 2 * self.key_dim + self.value_dim
        # nn.Conv1d only holds the [C, 1, W] weight under transformers' name; the conv op runs it.
        self.conv1d = nn.Conv1d(
            conv_dim,
            conv_dim,
            arch.linear_conv_kernel_dim,
            groups=conv_dim,
            bias=False,
            padding=arch.linear_conv_kernel_dim - 1,
            **factory,
        )
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, **factory))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, **factory))
        self.norm = RMSNorm(self.head_v_dim, arch.rms_norm_eps, False, ops, factory)
        self.out_proj = Linear(self.value_dim, D, False, ops, factory)
        self.in_proj_qkv = Linear(D, conv_dim, False, ops, factory)
        self.in_proj_z = Linear(D, self.value_dim, False, ops, factory)
        self.in_proj_b = Linear(D, self.num_v_heads, False, ops, factory)
        self.in_proj_a = Linear(D, self.num_v_heads, False, ops, factory)
        self.ops = ops
        self.sequence_parallel: UlyssesGroup | None = None  # set by MoeCausalLM.set_sequence_parallel
        self.checkpoint_tile_tokens = 0  # > 0: checkpointed in token tiles (see forward)
        self.reset_gates()

    @torch.no_grad()
    def reset_gates(self) -> None:
        """transformers' init: dt_bias = 1, A = U(0, 16) so A_log = log(A)."""
        nn.init.ones_(self.dt_bias)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0, 16).log_())

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: HostOffsets | None = None
    ) -> torch.Tensor:
        """x: [B, T, D] (B == 1 with cu_seqlens [N+1]; cu_seqlens_cpu: the same as host ints, or None);
        returns [B, T, D]. Under sequence parallelism T is this rank's share of the packed row and
        cu_seqlens describes the whole row.

        With `checkpoint_tile_tokens` > 0 (set by `models/fsdp_plan.checkpoint_in_tiles`) the mixer is
        its own activation-checkpoint unit, and a packed row longer than a tile runs as consecutive
        token tiles, each a unit: the recurrence's state and the conv's last inputs carry over, so
        backward recomputes and holds one tile at a time. One unit under SP (the all-to-all needs whole
        sequences) and for a batch of rows."""
        tile = self.checkpoint_tile_tokens
        if not tile or not torch.is_grad_enabled():  # nothing is saved without grad
            return self._mix(x, (cu_seqlens, cu_seqlens_cpu), (cu_seqlens, cu_seqlens_cpu))[0]
        if self.sequence_parallel is not None or x.shape[0] != 1 or x.shape[1] <= tile:
            offsets = (cu_seqlens, cu_seqlens_cpu)
            return checkpoint(self._mix, x, offsets, offsets, use_reentrant=False)[0]
        bounds = [0, x.shape[1]] if cu_seqlens is None else host_values(cu_seqlens, cu_seqlens_cpu)
        outputs, carry = [], None
        for start in range(0, x.shape[1], tile):
            span = tile_span(bounds, start, min(start + tile, x.shape[1]), self.conv1d.kernel_size[0] - 1)
            x_span = x[:, span.start - span.prefix : span.stop]
            y, carry = checkpoint(self._mix_tile, x_span, span, cu_seqlens is not None, carry, use_reentrant=False)
            outputs.append(y)
        return torch.cat(outputs, dim=1)

    def _mix_tile(self, x_span, span: TileSpan, packed: bool, carry):
        """One token tile: `carry` [HV, K, V] is the state of the sequence running into the tile (None
        when a sequence starts at the tile); returns (output, the state running out of it or None). The
        tile's offsets are made here from host ints, also in the recompute: a tensor input would be
        saved (offloaded) and come back as a tensor whose values the ops read from the device."""
        conv, gdn = (None, None), (None, None)
        if packed:
            conv, gdn = ((offsets_tensor(o, x_span.device), o) for o in (span.conv_cu, span.gdn_cu))
        initial = None
        if span.continues:
            initial = carry[None]
            if span.sequences > 1:  # the tile's other sequences start from zero
                initial = torch.cat([initial, initial.new_zeros(span.sequences - 1, *carry.shape)])
        y, final = self._mix(x_span, conv, gdn, span.prefix, initial, span.carries_on)
        return y, final[-1] if span.carries_on else None

    def _mix(self, x, conv_offsets, gdn_offsets, prefix: int = 0, initial_state=None, final_state: bool = False):
        """The mixer on x [B, P + T, D], whose first `prefix` (P) tokens only feed the conv (the previous
        tile's last inputs): conv_offsets (cu_seqlens, its host ints or None) describe all P + T tokens,
        gdn_offsets the T tokens. Returns (output [B, T, D], the recurrence's final state per sequence
        or None)."""
        (conv_cu, conv_cu_cpu), (gdn_cu, gdn_cu_cpu) = conv_offsets, gdn_offsets
        mixed_qkv, z, b, a = self.project(x)  # [B, P + T, C]: q | k | v channels
        z, b, a = z[:, prefix:], b[:, prefix:], a[:, prefix:]  # [B, T, HV * V], [B, T, HV] x 2
        B, T = z.shape[:2]
        z = z.reshape(B, T, self.num_v_heads, self.head_v_dim)
        conv_weight, A_log, dt_bias = self.conv1d.weight.squeeze(1), self.A_log, self.dt_bias
        if self.sequence_parallel is not None:
            # the conv and the recurrence need whole sequences: trade tokens for heads
            mixed_qkv, z, b, a = self._seq_to_heads(mixed_qkv, z, b, a)
            conv_weight, A_log, dt_bias = self._local_head_params()
        qkv = self.ops.conv1d(
            mixed_qkv, conv_weight, None, activation="silu", cu_seqlens=conv_cu, cu_seqlens_cpu=conv_cu_cpu
        )[:, prefix:]
        q, k, v = self.split_qkv(qkv, z.shape[2])  # under SP: this rank's heads of the whole packed row
        g, beta = self.gates(a, b, A_log, dt_bias)
        o, final = self.ops.gdn(
            q,
            k,
            v,
            g,
            beta,
            scale=None,
            initial_state=initial_state,
            output_final_state=final_state,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=gdn_cu,
            cu_seqlens_cpu=gdn_cu_cpu,
        )
        o = self.norm(o, gate=z)
        if self.sequence_parallel is not None:
            o = self.sequence_parallel.heads_to_seq(o)
        return self.out_proj(o.reshape(B, T, self.value_dim)), final

    def project(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [..., D] -> the conv's input [..., C], z [..., HV * V], b and a [..., HV]: one product where the
        weights are joined or in exact mode (`project_jointly`)."""
        return project_jointly(x, self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)

    def split_qkv(self, qkv: torch.Tensor, HV: int | None = None):
        """Conv output [..., C] of HV value heads (default all) and the matching key heads -> q, k
        [..., H, K], v [..., HV, V]."""
        HV = HV or self.num_v_heads
        H = HV * self.num_k_heads // self.num_v_heads
        q, k, v = qkv.split([H * self.head_k_dim, H * self.head_k_dim, HV * self.head_v_dim], dim=-1)
        lead = qkv.shape[:-1]
        return q.reshape(*lead, H, self.head_k_dim), k.reshape(*lead, H, self.head_k_dim), v.reshape(*lead, HV, -1)

    def gates(self, a: torch.Tensor, b: torch.Tensor, A_log=None, dt_bias=None):
        """g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) from the projections a, b [..., HV]
        (A_log / dt_bias: this rank's heads under SP, default all). The decay is computed in fp32 (fp64
        for an fp64 model): exp(A_log) overflows fp16 and bf16 rounding of g compounds over a sequence."""
        A_log = self.A_log if A_log is None else A_log
        dt_bias = self.dt_bias if dt_bias is None else dt_bias
        cd = torch.float64 if A_log.dtype == torch.float64 else torch.float32
        return -A_log.to(cd).exp() * F.softplus(a.to(cd) + dt_bias.to(cd)), torch.sigmoid(b)

    # ---- decoding (`models/decode.py` holds the slots) ----------------------------------------

    def prefill(self, x, offsets, cache, slot_index, starts=None) -> torch.Tensor:
        """Prompts packed in x [1, T, D] (offsets: cu_seqlens and its host ints) into `slot_index`'s
        slots (`cache`: the layer's `decode.LinearCache`), from fresh slots or (starts given) continuing each
        slot's conv and recurrent state: the
        conv runs over each chunk with its slot's last W-1 inputs in front (zeros for a fresh slot), and
        the rule starts from its slot's state. Writes the slots' states; returns [1, T, D]."""
        B, T, _ = x.shape
        cu, cu_cpu = offsets
        mixed_qkv, z, b, a = self.project(x)
        conv_weight = self.conv1d.weight.squeeze(1)
        initial_state = None
        if starts is not None:
            W1, N = conv_weight.shape[1] - 1, len(starts)
            continued = to_device(torch.tensor(starts, dtype=torch.long), x.device)[:, None, None] > 0
            before = torch.where(continued, cache.conv[slot_index], 0).transpose(1, 2)  # [N, W-1, C]
            pieces = [t for n in range(N) for t in (before[n], mixed_qkv[0, cu_cpu[n] : cu_cpu[n + 1]])]
            mixed_qkv = torch.cat(pieces)[None]  # each chunk with its W-1 inputs in front
            cu_cpu = [c + W1 * n for n, c in enumerate(cu_cpu)]
            cu = offsets_tensor(cu_cpu, x.device)
            keep = to_device(torch.cat([torch.arange(a + W1, b) for a, b in zip(cu_cpu[:-1], cu_cpu[1:])]), x.device)
            initial_state = torch.where(continued[..., None], cache.recurrent[slot_index], 0)
        cache.conv[slot_index] = conv1d_state_from_prefill(mixed_qkv, conv_weight.shape[1], cu, cu_seqlens_cpu=cu_cpu)
        qkv = self.ops.conv1d(mixed_qkv, conv_weight, None, activation="silu", cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
        if starts is not None:  # back to the chunks' own tokens and offsets
            qkv, (cu, cu_cpu) = qkv[:, keep], offsets
        q, k, v = self.split_qkv(qkv)
        g, beta = self.gates(a, b)
        o, final = self.ops.gdn(
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
        cache.recurrent[slot_index] = final.to(cache.recurrent.dtype)
        o = self.norm(o, gate=z.reshape(B, T, self.num_v_heads, self.head_v_dim))
        return self.out_proj(o.reshape(B, T, self.value_dim))

    def step(self, x, cache, active) -> torch.Tensor:
        """One token per slot [0, B): x [B, 1, D]; the conv and recurrent states of the active rows
        advance in place, inactive rows keep theirs. Returns [B, 1, D]."""
        B = x.shape[0]
        mixed, z, b, a = self.project(x[:, 0])  # [B, C], [B, HV * V], [B, HV] x 2
        g, beta = self.gates(a, b)
        weight = self.conv1d.weight.squeeze(1)
        qkv, _ = self.ops.conv1d_step(mixed, cache.conv[:B], weight, None, "silu", active, inplace=True)
        q, k, v = self.split_qkv(qkv)
        o, _ = self.ops.gdn_step(q, k, v, g, beta, cache.recurrent[:B], None, True, active, inplace=True)
        o = self.norm(o, gate=z.reshape(B, self.num_v_heads, self.head_v_dim))
        return self.out_proj(o.reshape(B, 1, self.value_dim))

    def step_positions(self, x, cache, counts) -> tuple[torch.Tensor, tuple]:
        """T tokens per slot [0, B) (speculative decoding's verification): x [B, T, D]; slot b's conv and recurrent
        state steps through its first counts[b] positions ([B] int on the device: T, or 0 for an idle slot) without
        being written (`advance_positions` commits the positions kept). Returns ([B, T, D], the steps' inputs for
        `advance_positions`)."""
        B, T, _ = x.shape
        mixed, z, b, a = self.project(x)  # [B, T, C], [B, T, HV * V], [B, T, HV] x 2
        g, beta = self.gates(a, b)  # [B, T, HV]
        qkv = self.ops.conv1d_positions(mixed, cache.conv[:B], self.conv1d.weight.squeeze(1), None, "silu", counts)
        q, k, v = self.split_qkv(qkv)
        o = self.ops.gdn_positions(q, k, v, g, beta, cache.recurrent[:B], None, True, counts)  # [B, T, HV, V]
        o = self.norm(o, gate=z.reshape(B, T, self.num_v_heads, self.head_v_dim))
        return self.out_proj(o.reshape(B, T, self.value_dim)), (mixed, q, k, v, g, beta)

    def advance_positions(self, inputs: tuple, cache, kept) -> None:
        """Step the cache's conv and recurrent states of slots [0, B) through the first kept[b] of the positions
        `step_positions` recorded (`inputs`), by the same steps ([B] int on the device; 0: the slot keeps its)."""
        mixed, q, k, v, g, beta = inputs
        B, weight = kept.numel(), self.conv1d.weight.squeeze(1)
        self.ops.conv1d_positions(mixed, cache.conv[:B], weight, None, "silu", kept, advance=True)
        self.ops.gdn_positions(q, k, v, g, beta, cache.recurrent[:B], None, True, kept, advance=True)

    def _seq_to_heads(self, mixed_qkv, z, b, a):
        """Ulysses exchange of the token-wise projections: mixed_qkv [B, T/sp, C], z [B, T/sp, HV, V],
        b / a [B, T/sp, HV] -> mixed_qkv [B, T, C/sp] (this rank's q | k | v heads, in conv-channel
        order), z [B, T, HV/sp, V], b / a [B, T, HV/sp]. One all-to-all."""
        B, t, _ = mixed_qkv.shape
        q, k, v = mixed_qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k, v, z, b, a = self.sequence_parallel.seq_to_heads_many(
            q.reshape(B, t, self.num_k_heads, self.head_k_dim),
            k.reshape(B, t, self.num_k_heads, self.head_k_dim),
            v.reshape(B, t, self.num_v_heads, self.head_v_dim),
            z,
            b,
            a,
        )
        return torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1), z, b, a

    def _local_head_params(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's conv1d rows [C/sp, W], A_log and dt_bias [HV/sp]. Slices of the full (under
        FSDP: unsharded) parameters, so their gradients land in this rank's rows. Key heads and value
        heads are split into contiguous blocks, so value head j still reads key head j // (HV/H)."""
        sp = self.sequence_parallel
        keys, values = sp.head_slice(self.num_k_heads), sp.head_slice(self.num_v_heads)
        Kd, Vd = self.head_k_dim, self.head_v_dim
        w = self.conv1d.weight.squeeze(1)
        q_rows = w[keys.start * Kd : keys.stop * Kd]
        k_rows = w[self.key_dim + keys.start * Kd : self.key_dim + keys.stop * Kd]
        v_rows = w[2 * self.key_dim + values.start * Vd : 2 * self.key_dim + values.stop * Vd]
        return torch.cat([q_rows, k_rows, v_rows]), self.A_log[values], self.dt_bias[values]
