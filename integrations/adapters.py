"""Our ops in the calling conventions of the anchors' models (VeOmni's kernel slots, transformers' modules).

Each `make_*` resolves our implementation once (`ops.dispatch.resolve`: triton on cuda/npu, the torch
reference on cpu, `VERL_MOE_OPS` overrides) and returns a callable that only reshapes and renames around
it. The returned callables carry `verl_moe_impl` (the resolved function), so a test can assert which
kernel a slot ended up with.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from verl_moe.ops import logprobs_and_entropy
from verl_moe.ops.dispatch import resolve


def _tag(fn: Callable, impl: Callable) -> Callable:
    fn.verl_moe_impl = impl
    return fn


def make_chunk_gated_delta_rule() -> Callable:
    """fla's `chunk_gated_delta_rule` calling convention: (q, k, v, g, beta, scale, initial_state,
    output_final_state, use_qk_l2norm_in_kernel, cu_seqlens) -> (o [B, T, HV, V], final_state or None)."""
    impl = resolve("gdn")

    def chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale=None,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        cu_seqlens=None,
        cu_seqlens_list=None,
        chunk_indices=None,
        chunk_indices_list=None,
    ):
        # VeOmni's NPU modeling also passes a host copy of the offsets (cu_seqlens_list: handed on, so the
        # op reads none back from the device) and its chunk tables (chunk_indices*: our kernels derive
        # their chunk plan from the offsets).
        on_host = cu_seqlens_list is not None and not (
            isinstance(cu_seqlens_list, torch.Tensor) and cu_seqlens_list.device.type != "cpu"
        )
        return impl(
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_list if on_host else None,
        )

    return _tag(chunk_gated_delta_rule, impl)


def make_causal_conv1d_btc() -> Callable:
    """fla's `causal_conv1d` convention (what VeOmni's slot calls): x [B, T, C], weight [C, W] ->
    (y [B, T, C], None); `backend` is fla's own switch and ignored; `seq_idx` is refused (pass cu_seqlens)."""
    impl = resolve("conv1d")

    def causal_conv1d(x, weight, bias=None, activation=None, seq_idx=None, backend=None, cu_seqlens=None):
        if seq_idx is not None:
            raise ValueError("verl_moe causal_conv1d takes packed sequences as cu_seqlens, not seq_idx")
        return impl(x, weight, bias, activation=activation, cu_seqlens=cu_seqlens), None

    return _tag(causal_conv1d, impl)


def make_causal_conv1d_bct() -> Callable:
    """The `causal_conv1d` package's convention (what transformers' GatedDeltaNet calls): x [B, C, T],
    weight [C, W] -> [B, C, T]. Packed sequences come as transformers' `cu_seq_lens_q` (5.17 passes its
    attention kwargs on) or as a `seq_idx` [1, T] of sequence ids (5.10); other attention kwargs are unused."""
    impl = resolve("conv1d")

    def causal_conv1d_fn(x, weight, bias=None, activation=None, seq_idx=None, **attention_kwargs):
        cu_seqlens = attention_kwargs.get("cu_seq_lens_q")
        if cu_seqlens is None and seq_idx is not None:
            if seq_idx.shape[0] != 1:
                raise ValueError(f"seq_idx needs batch 1 (packed sequences), got {tuple(seq_idx.shape)}")
            counts = torch.bincount(seq_idx[0].long())
            cu_seqlens = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
        y = impl(x.transpose(1, 2), weight, bias, activation=activation, cu_seqlens=cu_seqlens)
        return y.transpose(1, 2)

    return _tag(causal_conv1d_fn, impl)


def make_rms_norm(unit_offset: bool) -> Callable:
    """(x, weight, eps) -> RMSNorm(x) * weight ((1 + weight) with unit_offset, Qwen3.5's norms)."""
    impl = resolve("norm")

    def rms_norm(x, weight, eps=1e-6):
        return impl(x, weight, eps, unit_offset=unit_offset)

    return _tag(rms_norm, impl)


def make_apply_rotary_pos_emb() -> Callable:
    """transformers' `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`: q/k [B, H, T, K] (unsqueeze_dim 1)
    or [B, T, H, K] (2); cos/sin [B, T, rotary_dim] with rotary_dim <= K (partial rotary passes the rest)."""
    impl = resolve("rope")

    def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        # position_ids: an old transformers argument VeOmni's Qwen3-MoE modeling still passes (unused there too)
        if unsqueeze_dim not in (1, 2):
            raise ValueError(f"unsqueeze_dim must be 1 ([B, H, T, K]) or 2 ([B, T, H, K]), got {unsqueeze_dim}")
        if cos.shape[0] == 1 and q.shape[0] > 1:  # one position row shared by the batch: a stride-0 view
            cos, sin = cos.expand(q.shape[0], -1, -1), sin.expand(q.shape[0], -1, -1)
        if unsqueeze_dim == 2:
            return impl(q, k, cos, sin)
        q_out, k_out = impl(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q_out.transpose(1, 2), k_out.transpose(1, 2)

    return _tag(apply_rotary_pos_emb, impl)


def make_moe_experts_forward() -> Callable:
    """Experts module forward (module, hidden [N, D], top_k_index [N, TOPK], top_k_weights [N, TOPK]) over
    the module's transformers-layout `gate_up_proj` [E, 2I, D] and `down_proj` [E, D, I]."""
    impl = resolve("experts")

    def moe_experts_forward(module, hidden_states, top_k_index, top_k_weights):
        return impl(hidden_states, module.gate_up_proj, module.down_proj, top_k_index, top_k_weights)

    return _tag(moe_experts_forward, impl)


def make_route(norm_topk_prob: bool | None) -> Callable:
    """Router module forward (module, hidden [..., D]) -> (logits [N, E], weights [N, TOPK], ids [N, TOPK]),
    computed in fp32 (our routing: the combine weights stay fp32). norm_topk_prob None reads the module's."""
    impl = resolve("router")

    def route(module, hidden_states):
        hidden = hidden_states.reshape(-1, module.hidden_dim)
        norm = module.norm_topk_prob if norm_topk_prob is None else norm_topk_prob
        return impl(hidden, module.weight, module.top_k, norm, dtype=torch.float32)

    return _tag(route, impl)


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * weight * silu(gate) over the last dim, on our norm kernel; the constructor takes
    fla's `FusedRMSNormGated` arguments (what VeOmni's `rms_norm_gated` slot builds)."""

    def __init__(self, hidden_size, eps=1e-6, activation="silu", device=None, dtype=None):
        super().__init__()
        if activation not in ("silu", "swish"):
            raise ValueError(f"verl_moe's gated RMSNorm gates with silu, got activation={activation!r}")
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps
        self._norm = resolve("norm")

    def forward(self, x, gate):
        return self._norm(x, self.weight, self.eps, gate=gate)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def make_gated_rms_norm_forward() -> Callable:
    """Forward for transformers' `Qwen3_5MoeRMSNormGated` (weight, variance_epsilon): (module, x, gate)."""
    impl = resolve("norm")

    def forward(module, hidden_states, gate=None):
        return impl(hidden_states, module.weight, module.variance_epsilon, gate=gate)

    return _tag(forward, impl)


def masked_logprobs(hidden, weight, labels, ignore_index: int, temperature) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (log p(label), entropy) through our fused LM head; hidden [..., D], labels [...], temperature
    a float or a tensor of one value or one per label; zero (and no gradient) where labels == ignore_index.
    Returns fp32 tensors shaped like labels."""
    shape = labels.shape
    if torch.is_tensor(temperature):  # per token, laid out like labels; or one value
        temperature = temperature.reshape(()) if temperature.numel() == 1 else temperature.reshape(-1)
    flat_labels = labels.reshape(-1)
    keep = flat_labels != ignore_index
    safe = torch.where(keep, flat_labels, torch.zeros_like(flat_labels)).long()
    logp, entropy = logprobs_and_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, safe, temperature)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    return torch.where(keep, logp, zero).reshape(shape), torch.where(keep, entropy, zero).reshape(shape)
