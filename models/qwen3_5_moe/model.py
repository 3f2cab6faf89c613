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
conv1d.weight, A_log and dt_bias (see `verl_moe.models.parallel`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..arch import ArchConfig
from ..layers import ResolvedOps, RMSNorm

if TYPE_CHECKING:
    from ..parallel import UlyssesGroup


class GatedDeltaNet(nn.Module):
    """Linear-attention token mixer; parameter names equal transformers' `Qwen3_5MoeGatedDeltaNet`."""

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
        self.out_proj = nn.Linear(self.value_dim, D, bias=False, **factory)
        self.in_proj_qkv = nn.Linear(D, conv_dim, bias=False, **factory)
        self.in_proj_z = nn.Linear(D, self.value_dim, bias=False, **factory)
        self.in_proj_b = nn.Linear(D, self.num_v_heads, bias=False, **factory)
        self.in_proj_a = nn.Linear(D, self.num_v_heads, bias=False, **factory)
        self.ops = ops
        self.sequence_parallel: UlyssesGroup | None = None  # set by MoeCausalLM.set_sequence_parallel
        self.reset_gates()

    @torch.no_grad()
    def reset_gates(self) -> None:
        """transformers' init: dt_bias = 1, A = U(0, 16) so A_log = log(A)."""
        nn.init.ones_(self.dt_bias)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0, 16).log_())

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        """x: [B, T, D] (B == 1 with cu_seqlens [N+1]); returns [B, T, D]. Under sequence
        parallelism T is this rank's share of the packed row and cu_seqlens describes the whole row."""
        B, T, _ = x.shape
        mixed_qkv = self.in_proj_qkv(x)  # [B, T, C]: q | k | v channels
        z = self.in_proj_z(x).reshape(B, T, self.num_v_heads, self.head_v_dim)
        b, a = self.in_proj_b(x), self.in_proj_a(x)  # [B, T, HV]
        conv_weight, A_log, dt_bias = self.conv1d.weight.squeeze(1), self.A_log, self.dt_bias
        if self.sequence_parallel is not None:
            # the conv and the recurrence need whole sequences: trade tokens for heads
            mixed_qkv, z, b, a = self._seq_to_heads(mixed_qkv, z, b, a)
            conv_weight, A_log, dt_bias = self._local_head_params()
        T_row, HV = z.shape[1:3]  # under SP: the whole packed row, this rank's value heads
        H = HV * self.num_k_heads // self.num_v_heads
        qkv = self.ops.conv1d(mixed_qkv, conv_weight, None, activation="silu", cu_seqlens=cu_seqlens)
        q, k, v = qkv.split([H * self.head_k_dim, H * self.head_k_dim, HV * self.head_v_dim], dim=-1)
        q = q.reshape(B, T_row, H, self.head_k_dim)
        k = k.reshape(B, T_row, H, self.head_k_dim)
        v = v.reshape(B, T_row, HV, self.head_v_dim)
        beta = torch.sigmoid(b)
        # The decay is computed in fp32 (fp64 for an fp64 model): exp(A_log) overflows fp16 and
        # bf16 rounding of g compounds over the whole sequence.
        cd = torch.float64 if A_log.dtype == torch.float64 else torch.float32
        g = -A_log.to(cd).exp() * F.softplus(a.to(cd) + dt_bias.to(cd))
        o, _ = self.ops.gdn(
            q,
            k,
            v,
            g,
            beta,
            scale=None,
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu_seqlens,
        )
        o = self.norm(o, gate=z)
        if self.sequence_parallel is not None:
            o = self.sequence_parallel.heads_to_seq(o)
        return self.out_proj(o.reshape(B, T, self.value_dim))

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
