"""Qwen3.5-MoE's own layer: the GatedDeltaNet linear attention. Everything else of the model
(full attention with output gate, MoE with shared expert, decoder) is in `models/layers.py` and
`models/causal_lm.py`, shared with Qwen3-MoE.

Per token: q|k|v = silu(causal_conv1d(in_proj_qkv(x))), split into H query/key heads of K and
HV value heads of V; beta = sigmoid(in_proj_b(x)); g = -exp(A_log) * softplus(in_proj_a(x) +
dt_bias) (fp32); o = gated_delta_rule(q, k, v, g, beta) with q/k l2-normalised; then the gated
RMSNorm with z = in_proj_z(x) and out_proj.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..arch import ArchConfig
from ..layers import ResolvedOps, RMSNorm


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
        self.reset_gates()

    @torch.no_grad()
    def reset_gates(self) -> None:
        """transformers' init: dt_bias = 1, A = U(0, 16) so A_log = log(A)."""
        nn.init.ones_(self.dt_bias)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0, 16).log_())

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        """x: [B, T, D] (B == 1 with cu_seqlens [N+1]); returns [B, T, D]."""
        B, T, _ = x.shape
        qkv = self.ops.conv1d(
            self.in_proj_qkv(x), self.conv1d.weight.squeeze(1), None, activation="silu", cu_seqlens=cu_seqlens
        )
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(B, T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(B, T, self.num_v_heads, self.head_v_dim)
        beta = torch.sigmoid(self.in_proj_b(x))
        # The decay is computed in fp32 (fp64 for an fp64 model): exp(A_log) overflows fp16 and
        # bf16 rounding of g compounds over the whole sequence.
        cd = torch.float64 if self.A_log.dtype == torch.float64 else torch.float32
        g = -self.A_log.to(cd).exp() * F.softplus(self.in_proj_a(x).to(cd) + self.dt_bias.to(cd))
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
        z = self.in_proj_z(x).reshape(B, T, self.num_v_heads, self.head_v_dim)
        o = self.norm(o, gate=z)
        return self.out_proj(o.reshape(B, T, self.value_dim))
