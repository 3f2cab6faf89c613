"""Modules shared by Qwen3.5-MoE and Qwen3-MoE: norm, full attention, dense MLP, router, experts,
sparse MoE block. Parameter names and shapes equal transformers' so HF state dicts load strictly.

Every module receives the resolved ops (`ResolvedOps`) at construction and keeps them on the
instance: no module globals, so two models in one process may use different implementations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from ..ops.varlen import HostOffsets
from .arch import ArchConfig

if TYPE_CHECKING:
    from .process_groups import ExpertParallelGroup, UlyssesGroup


@dataclass(frozen=True)
class ResolvedOps:
    """The callables one model instance uses, for training and for decoding (see `verl_moe.ops.<op>.IMPLS`
    for their contracts; `logits(hidden, weight)` is the LM head's product). The linear-attention ops
    are None for models without linear-attention layers, the attention ones for models without attention
    layers. In exact mode (`OpsConfig.exact`) each is its op's exact form."""

    norm: Callable
    rope: Callable
    linear: Callable
    logits: Callable
    attention: Callable | None
    attention_decode: Callable | None
    attention_cached: Callable | None
    router: Callable
    experts: Callable
    sampling: Callable
    router_dtype: torch.dtype
    gdn: Callable | None = None
    gdn_step: Callable | None = None
    gdn_positions: Callable | None = None
    conv1d: Callable | None = None
    conv1d_step: Callable | None = None
    conv1d_positions: Callable | None = None
    exact: bool = False  # exact mode (`OpsConfig.exact`): `project_jointly` then always runs one product


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) whose product is the resolved `linear` op: torch's GEMM, or
    exact mode's batch-invariant form."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ops: ResolvedOps, factory: dict):
        super().__init__(in_features, out_features, bias=bias, **factory)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias)


def project_jointly(x: torch.Tensor, *linears: Linear) -> list[torch.Tensor]:
    """x [..., K] through projections of that one input (a layer's `joint_projections`): their outputs, in order.

    One product serves them all where their weights are consecutive rows of one tensor (`join_projections`,
    done for a decoder's model: a decode step's narrow projections, e.g. GatedDeltaNet's beta and decay heads,
    then ride in the wide one's tiles instead of leaving most of the device idle) and, in exact mode,
    everywhere: over their concatenation where not joined (the trainer), so the trainer's product has the
    rollout's width and with it the same tiles and bits. Otherwise (fast mode's training, adapters) each
    projection runs its own product."""
    if any(type(linear) is not Linear for linear in linears):  # adapters (models/lora.py) add their own terms
        return [linear(x) for linear in linears]
    ops = linears[0].ops
    biases = [linear.bias for linear in linears]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return [linear(x) for linear in linears]
    weights = [linear.weight for linear in linears]
    weight = None
    if not (torch.is_grad_enabled() and any(w.requires_grad for w in weights)):  # a view of rows has no gradient
        weight = joined_weight(weights)
    if weight is None and ops.exact:
        weight = torch.cat(weights)
    if weight is None:
        return [linear(x) for linear in linears]
    bias = None if biases[0] is None else torch.cat(biases)
    return list(ops.linear(x, weight, bias).split([w.shape[0] for w in weights], dim=-1))


def joined_weight(weights: list[torch.Tensor]) -> torch.Tensor | None:
    """The [sum of N, K] tensor whose consecutive rows are `weights` ([N_i, K] each), where they are stored so
    (`join_projections`), else None."""
    first = weights[0]
    if any(isinstance(w, DTensor) or w.device.type == "meta" for w in weights):
        return None
    base, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for w in weights:
        if not w.is_contiguous() or w.untyped_storage().data_ptr() != base or w.storage_offset() != offset:
            return None
        if w.dtype != first.dtype or w.shape[1:] != first.shape[1:]:
            return None
        offset += w.numel()
    return first.as_strided((sum(w.shape[0] for w in weights), first.shape[1]), (first.shape[1], 1))


@torch.no_grad()
def join_projections(model: nn.Module) -> None:
    """Store each layer's projections of one input (every module's `joint_projections`: names of `Linear`
    submodules) as consecutive rows of one tensor, so that `project_jointly` runs them as one product. The
    parameters keep their names, shapes and values and become views of that tensor: loading weights into them
    (`copy_`) fills it. Only the module's own parameter objects change: an optimizer made before holds the old
    ones. Groups already joined, with adapters, or of DTensors are left as they are."""
    for module in model.modules():
        for names in getattr(module, "joint_projections", ()):
            linears = [module.get_submodule(name) for name in names]
            if any(type(linear) is not Linear for linear in linears):
                continue
            weights = [linear.weight for linear in linears]
            if any(isinstance(w, DTensor) for w in weights) or joined_weight(weights) is not None:
                continue
            joined = torch.cat(weights)
            for linear, rows in zip(linears, joined.split([w.shape[0] for w in weights])):
                linear.weight = nn.Parameter(rows, requires_grad=linear.weight.requires_grad)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with a [D] weight; (1 + weight) when unit_offset (Qwen3.5).
    With `gate`, returns norm(x) * weight * silu(gate) (plain weight only). With `residual`, normalises
    h = x + residual and returns (norm(h), h): the decoder's residual add and norm in one op."""

    def __init__(self, dim: int, eps: float, unit_offset: bool, ops: ResolvedOps, factory: dict):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, **factory))
        self.eps, self.unit_offset, self.ops = eps, unit_offset, ops
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Both conventions start as the identity scale.
        nn.init.zeros_(self.weight) if self.unit_offset else nn.init.ones_(self.weight)

    def forward(
        self, x: torch.Tensor, gate: torch.Tensor | None = None, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if gate is not None:
            return self.ops.norm(x, self.weight, self.eps, gate=gate)
        if residual is not None:
            return self.ops.norm(x, self.weight, self.eps, unit_offset=self.unit_offset, residual=residual)
        return self.ops.norm(x, self.weight, self.eps, unit_offset=self.unit_offset)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, unit_offset={self.unit_offset}"


class Attention(nn.Module):
    """Causal GQA with per-head q/k RMSNorm, (partial) RoPE and, for Qwen3.5, a sigmoid output gate
    emitted by q_proj (per head: K query features, then K gate features)."""

    joint_projections = (("q_proj", "k_proj", "v_proj"),)

    def __init__(self, arch: ArchConfig, ops: ResolvedOps, factory: dict):
        super().__init__()
        D, H, HKV, K = arch.hidden_size, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = H, HKV, K
        self.output_gate = arch.attn_output_gate
        bias = arch.attention_bias
        self.q_proj = Linear(D, H * K * (2 if self.output_gate else 1), bias, ops, factory)
        self.k_proj = Linear(D, HKV * K, bias, ops, factory)
        self.v_proj = Linear(D, HKV * K, bias, ops, factory)
        self.o_proj = Linear(H * K, D, bias, ops, factory)
        self.q_norm = RMSNorm(K, arch.rms_norm_eps, arch.norm_unit_offset, ops, factory)
        self.k_norm = RMSNorm(K, arch.rms_norm_eps, arch.norm_unit_offset, ops, factory)
        self.ops = ops
        self.sequence_parallel: UlyssesGroup | None = None  # set by MoeCausalLM.set_sequence_parallel

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        cu_seqlens_cpu: HostOffsets | None = None,
    ) -> torch.Tensor:
        """x: [B, T, D]; cos/sin: [B, T, rotary_dim]; cu_seqlens_cpu: cu_seqlens as host ints or None;
        returns [B, T, D]. Under sequence parallelism T is this rank's share of the packed row and
        cu_seqlens describes the whole row."""
        q, k, v, gate = self.project(x, cos, sin)
        sp = self.sequence_parallel
        if sp is not None:
            # attention needs whole sequences: trade tokens for heads (the gate stays per token)
            q, k, v = sp.seq_to_heads_many(q, sp.expand_kv_heads(k), sp.expand_kv_heads(v))
        o = self.ops.attention(q, k, v, scale=self.head_dim**-0.5, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
        if sp is not None:
            o = sp.heads_to_seq(o)
        return self.output(o, gate)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, D] -> q [B, T, H, K], k / v [B, T, HKV, K] after the norms and rope, and the output
        gate [B, T, H, K] (None without one)."""
        B, T, _ = x.shape
        q, k, v = project_jointly(x, self.q_proj, self.k_proj, self.v_proj)
        q = q.view(B, T, self.num_heads, -1)
        gate = None
        if self.output_gate:
            q, gate = q.split(self.head_dim, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(B, T, self.num_kv_heads, self.head_dim))
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        q, k = self.ops.rope(q, k, cos, sin)
        return q, k, v, gate

    def output(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """o [B, T, H, V] -> o_proj(o * sigmoid(gate)) [B, T, D]."""
        B, T = o.shape[:2]
        o = o.reshape(B, T, -1)
        if gate is not None:
            o = o * torch.sigmoid(gate.reshape(B, T, -1))
        return self.o_proj(o)

    # ---- decoding (`models/decode.py` holds the slots) ----------------------------------------

    def prefill(self, x, cos, sin, offsets, cache, token_slot, token_pos, chunks=None):
        """Prompts packed in x [1, T, D] (offsets: cu_seqlens and its host ints) into their slots: each
        token's k / v go to `cache` (the layer's `decode.AttentionCache`) at (token_slot, token_pos).
        Fresh slots (chunks None) attend within the prompt by the packed op, as the trainer's forward;
        chunks [(slot, start)] that continue their slots attend to the slot's cache (`attention.cached`).
        Returns [1, T, D]."""
        q, k, v, gate = self.project(x, cos, sin)
        cache.k[token_slot, :, token_pos] = k[0]
        cache.v[token_slot, :, token_pos] = v[0]
        scale = self.head_dim**-0.5
        cu, cu_cpu = offsets
        if chunks is None:
            o = self.ops.attention(q, k, v, scale=scale, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
        else:
            slots, starts = zip(*chunks)
            o = self.ops.attention_cached(q[0], cache.k, cache.v, slots, starts, cu_cpu, scale)[None]
        return self.output(o, gate)

    def step_positions(self, x, cos, sin, cache, positions, active, slots=None) -> torch.Tensor:
        """T tokens per row at `positions` [B, T] of its slot (speculative decoding): x [B, T, D]; row b's slot
        is slots[b] ([B] int64 on the device; default b). Each token's k / v go to the cache at its position
        where `active` ([B] per row, or [B, T] per token) holds, and each attends to its slot's positions up
        to its own (`attention_decode` over B * T rows, a slot per row; a token not active reads one position:
        its output is undefined). Returns [B, T, D]."""
        B, T = positions.shape
        q, k, v, gate = self.project(x, cos, sin)  # [B, T, H | HKV, K]
        rows = (torch.arange(B, device=x.device) if slots is None else slots)[:, None].expand(B, T)
        at = positions.clamp(max=cache.k.shape[2] - 1)
        live = (active if active.dim() == 2 else active[:, None]).expand(B, T)
        keep = live[:, :, None, None]
        cache.k[rows, :, at] = torch.where(keep, k, cache.k[rows, :, at])
        cache.v[rows, :, at] = torch.where(keep, v, cache.v[rows, :, at])
        seen = torch.where(live, at + 1, 1)  # an idle token's output is not used: it reads one position
        o = self.ops.attention_decode(
            q.reshape(B * T, *q.shape[2:]), cache.k, cache.v, seen.reshape(-1), self.head_dim**-0.5,
            slots=rows.reshape(-1),
        )  # fmt: skip
        return self.output(o.view(B, T, *o.shape[1:]), gate)

    def step(self, x, cos, sin, cache, kv_positions, active) -> torch.Tensor:
        """One token per slot [0, B): x [B, 1, D]; kv_positions (rows, the position each row writes, the
        positions each row sees), from `MoeDecoder`; inactive rows leave the cache as it was."""
        q, k, v, gate = self.project(x, cos, sin)  # [B, 1, H | HKV, K]
        rows, at, counts = kv_positions
        keep = active[:, None, None]
        cache.k[rows, :, at] = torch.where(keep, k[:, 0], cache.k[rows, :, at])
        cache.v[rows, :, at] = torch.where(keep, v[:, 0], cache.v[rows, :, at])
        o = self.ops.attention_decode(q[:, 0], cache.k, cache.v, counts, self.head_dim**-0.5)  # [B, H, V]
        return self.output(o[:, None], gate)


class MLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)). x: [..., D] -> [..., D]."""

    joint_projections = (("gate_proj", "up_proj"),)

    def __init__(self, hidden_size: int, intermediate_size: int, ops: ResolvedOps, factory: dict):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, False, ops, factory)
        self.up_proj = Linear(hidden_size, intermediate_size, False, ops, factory)
        self.down_proj = Linear(intermediate_size, hidden_size, False, ops, factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(*project_jointly(x, self.gate_proj, self.up_proj))

    def down(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """down_proj(silu(gate) * up) from the gate and up projections."""
        return self.down_proj(F.silu(gate) * up)


class DenseMLP(MLP):
    """A dense MLP in the MoE slot (Qwen3-MoE `mlp_only_layers`); returns (out, None) like MoeBlock."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return super().forward(x), None


class RoutingOverride(Protocol):
    """What a router asks, once per call, when an override is set (`TopKRouter.override`; the
    engines' router replay, `engines/router_replay.py`, owns it): given the freely chosen ids
    [N, TOPK] int64, the ids to use instead ([N, TOPK] int64), or None to keep the free choice.
    `rows` (a tiled MoE block only, `MoeBlock.checkpoint_tile_tokens`) is the call's contiguous
    slice of the layer's flat tokens; a call without tiles passes only free_idx (all the tokens)."""

    def __call__(self, free_idx: torch.Tensor, rows: slice | None = None) -> torch.Tensor | None: ...


class TopKRouter(nn.Module):
    """Router weight [E, D] (transformers' `mlp.gate.weight`) and the routing call.

    `override` (None: free routing) may replace the chosen experts; the combine weights are then
    `replayed_topk_weight`'s, from this call's logits, so the router still gets gradients."""

    def __init__(self, arch: ArchConfig, ops: ResolvedOps, factory: dict):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(arch.num_experts, arch.hidden_size, **factory))
        self.top_k, self.norm_topk_prob, self.ops = arch.num_experts_per_tok, arch.norm_topk_prob, ops
        self.override: RoutingOverride | None = None

    def forward(
        self, hidden: torch.Tensor, rows: slice | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden: [N, D] -> logits [N, E], topk_weight [N, TOPK] (router dtype), topk_idx [N, TOPK].
        rows: which of the layer's flat tokens `hidden` holds (one tile), None for all of them."""
        routed = self.ops.router(hidden, self.weight, self.top_k, self.norm_topk_prob, dtype=self.ops.router_dtype)
        if self.override is None:
            forced = None
        else:
            forced = self.override(routed[2]) if rows is None else self.override(routed[2], rows)
        if forced is None:
            return routed
        logits, topk_weight, topk_idx = routed
        return logits, replayed_topk_weight(logits, topk_weight, topk_idx, forced, self.norm_topk_prob), forced


def replayed_topk_weight(
    logits: torch.Tensor,
    topk_weight: torch.Tensor,
    topk_idx: torch.Tensor,
    forced_idx: torch.Tensor,
    norm_topk_prob: bool,
) -> torch.Tensor:
    """Combine weights [N, TOPK] (topk_weight's dtype) of the experts `forced_idx` [N, TOPK]: the
    softmax over all E of `logits` [N, E] (in fp32 at least) gathered at the ids, renormalised to
    sum 1 per token when norm_topk_prob. Rows whose forced ids equal the free ones `topk_idx` (same
    order) keep the router's own `topk_weight` (bitwise free routing where nothing changes)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    weight = probs.gather(-1, forced_idx)
    if norm_topk_prob:
        weight = weight / weight.sum(dim=-1, keepdim=True)
    unchanged = (forced_idx == topk_idx).all(dim=-1, keepdim=True)
    return torch.where(unchanged, topk_weight, weight.to(topk_weight.dtype))


class Experts(nn.Module):
    """Fused expert weights: gate_up_proj [E, 2I, D] (gate rows first), down_proj [E, D, I].

    Under expert parallelism (`expert_parallel` set by `MoeCausalLM.set_expert_parallel`) the
    weights are DTensors sharded over the expert dim on the EP mesh; each rank computes with its
    local experts and exchanges token copies with the other ranks of the group.
    """

    def __init__(self, arch: ArchConfig, ops: ResolvedOps, factory: dict):
        super().__init__()
        E, D, I = arch.num_experts, arch.hidden_size, arch.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D, **factory))
        self.down_proj = nn.Parameter(torch.empty(E, D, I, **factory))
        self.ops = ops
        self.expert_parallel: ExpertParallelGroup | None = None

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E_local, 2I, D], down [E_local, D, I]) as the experts op takes them: this rank's
        experts (the local block under expert parallelism). `models/lora.py` adds its adapters here."""
        return tuple(w.to_local() if isinstance(w, DTensor) else w for w in (self.gate_up_proj, self.down_proj))

    def forward(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.expert_weights()
        if self.expert_parallel is None:
            return self.ops.experts(hidden, gate_up, down, topk_idx, topk_weight)
        from ..ops.experts.expert_parallel import moe_experts_expert_parallel

        return moe_experts_expert_parallel(
            hidden, gate_up, down, topk_idx, topk_weight, self.expert_parallel, experts=self.ops.experts
        )


class MoeBlock(nn.Module):
    """Routed experts plus, when configured, a shared expert scaled by sigmoid(shared_expert_gate(x)).

    `checkpoint_tile_tokens` (0: off) > 0 runs the flat tokens in contiguous tiles of at most that
    many, each tile (router, experts, shared expert) one activation-checkpoint unit: autograd keeps
    only the tile inputs (views of x) and the backward recomputes one tile at a time, so a long
    sequence's MoE backward holds one tile's permuted rows and expert activations, not all of them.
    Under expert parallelism the block runs one tile (still checkpointed): the all-to-all
    collectives need the same number of calls on every rank, and the ranks' token counts differ.
    """

    joint_projections: tuple[tuple[str, ...], ...] = ()

    def __init__(self, arch: ArchConfig, ops: ResolvedOps, factory: dict):
        super().__init__()
        self.gate = TopKRouter(arch, ops, factory)
        self.experts = Experts(arch, ops, factory)
        if arch.shared_expert_intermediate_size > 0:
            self.shared_expert = MLP(arch.hidden_size, arch.shared_expert_intermediate_size, ops, factory)
            self.shared_expert_gate = Linear(arch.hidden_size, 1, False, ops, factory)
            # the shared expert's gate and up projections and its scalar gate: one product (`project_jointly`)
            self.joint_projections = (("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert_gate"),)
        else:
            self.shared_expert = None
        self.checkpoint_tile_tokens: int = 0

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, D] -> (out [B, T, D], router_logits [B*T, E] in the router dtype)."""
        flat = x.reshape(-1, x.shape[-1])
        if self.checkpoint_tile_tokens <= 0:
            out, logits = self._tile(flat, None)
            return unflatten_tokens(out, x.shape), logits
        n = flat.shape[0]
        tile = max(n, 1) if self.experts.expert_parallel is not None else self.checkpoint_tile_tokens
        outs, logits = [], []
        for start in range(0, max(n, 1), tile):  # an empty input is one (empty) tile: EP's collectives run
            rows = slice(start, min(start + tile, n))
            if torch.is_grad_enabled():
                out, lg = checkpoint(self._tile, flat[rows], rows, use_reentrant=False)
            else:  # nothing to save: checkpointing would only add its hooks
                out, lg = self._tile(flat[rows], rows)
            outs.append(out)
            logits.append(lg)
        if len(outs) == 1:
            return unflatten_tokens(outs[0], x.shape), logits[0]
        return unflatten_tokens(torch.cat(outs), x.shape), torch.cat(logits)

    def _tile(self, flat: torch.Tensor, rows: slice | None) -> tuple[torch.Tensor, torch.Tensor]:
        """flat: [n, D], the layer's tokens `rows` (None: all) -> (out [n, D], router logits [n, E])."""
        logits, topk_weight, topk_idx = self.gate(flat, rows)
        out = self.experts(flat, topk_idx, topk_weight)
        if self.shared_expert is not None:
            shared = self.shared_expert
            gate, up, scale = project_jointly(flat, shared.gate_proj, shared.up_proj, self.shared_expert_gate)
            out = out + torch.sigmoid(scale) * shared.down(gate, up)
        return out, logits


def unflatten_tokens(flat: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """flat [B*T, D], a result this block just made, as `shape` [B, T, D]: the same storage, but not
    a view in autograd's eyes. The block's output leaves the decoder layer, and FSDP2 warns about
    every view a sharded module returns (an in-place op on a view would bypass the pre-backward
    hook it puts on the output). `flat` is fresh and nothing holds or saves it (the experts ops,
    the shared-expert add and the tiles' cat keep no reference to their output), so this reshape,
    torch's own for the folded products of matmul, neither copies nor hides a write from anyone;
    its backward reshapes the gradient as a view's would."""
    return torch.ops.aten._unsafe_view(flat, shape)
