"""How a `MoeCausalLM` / `MoeVisionLM` is split over ranks: the one place that knows which submodules shard how.

Engines decide the layout (meshes, dtypes, offload, whether experts are split over ranks) and pass it
as an `FsdpPlan`; `fully_shard_model` turns it into FSDP2 units:

- every MoE router (`TopKRouter`) is its own unit in the master dtype (fp32), for compute and gradient
  reduction: bf16 rounding of its weights flips top-k expert sets;
- under expert parallelism every `Experts` holds this rank's block of E / ep experts as DTensors
  (`Shard(0)` on the "ep" mesh, `shard_experts`) and is its own unit over the remaining expert-mesh
  dims, sharded along dim 1 (as VeOmni does); without it the experts shard with their layer;
- every decoder layer is one unit in the compute dtype (with activation checkpointing when asked, and
  activation offload: what autograd saves at each layer, its inputs under checkpointing, waits for
  backward in host memory, `models/activation_offload.py`). With offload the checkpoint units are
  inside the layer (`checkpoint_in_tiles`): their inputs cost host memory, not device memory, and
  backward then holds one tile's recompute instead of a whole layer's;
- the MTP module's decoder layers (`mtp.layers`, Qwen3.5 configs with MTP layers) shard as the decoder's,
  routers and experts included; the rest of the module (its fc and norms) is one unit after them;
- a vision-language model's tower (`model.visual`): each ViT block one unit (checkpointed like the
  decoder layers), then the tower itself (patch embedding, position table, merger) one unit, both in
  the compute dtype; the model then runs the tower in every forward (`set_tower_every_forward`: a
  dummy image with zero contribution on a rank whose micro-batch has none), so every rank issues the
  tower's all-gathers and reduce-scatters and none waits forever;
- the root unit (embeddings, final norm, lm_head, and whatever wraps the model: the engine's log-prob
  head) does not cast its inputs, so a per-token temperature stays fp32. With tied word embeddings
  lm_head.weight is embed_tokens.weight: one parameter of the root unit, which FSDP2 shards once and
  points both modules at (unsharded in the root's forward, so both uses' gradients add before the one
  reduce-scatter); `check_tied_embeddings` refuses a layout that splits the pair over two units.

Sequence parallelism shards no parameter: the model's token mixers take their head slices of the
unsharded parameters inside each unit (`models/process_groups.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed._composable import checkpoint as activation_checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from .activation_offload import ActivationOffload, select_layers
from .layers import Experts, MoeBlock, TopKRouter
from .process_groups import ExpertParallelGroup


@dataclass(frozen=True)
class ExpertPlan:
    """Experts split over ranks: `group` (this rank's index and the EP size), `ep_mesh` (the 1-D "ep"
    mesh the expert blocks are DTensors on) and `fsdp_mesh` (the mesh FSDP shards each block over)."""

    group: ExpertParallelGroup
    ep_mesh: DeviceMesh
    fsdp_mesh: DeviceMesh


@dataclass(frozen=True)
class FsdpPlan:
    """What an engine chose. compute_dtype / reduce_dtype: None keeps the master dtype (no cast).
    experts: None shards the experts with their decoder layer. activation_offload: the decoder layers'
    saved tensors go to host memory; activation_offload_modules: which layers (VeOmni's name patterns,
    `select_layers`; empty = all). checkpoint_tile_tokens: > 0 checkpoints inside each decoder layer in
    tiles of that many tokens (`checkpoint_in_tiles`) instead of around it."""

    mesh: DeviceMesh
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    reshard_after_forward: bool = True
    offload_policy: OffloadPolicy | None = None
    activation_checkpointing: bool = False
    experts: ExpertPlan | None = None
    activation_offload: bool = False
    activation_offload_modules: tuple[str, ...] = ()
    checkpoint_tile_tokens: int = 0


# Token tile of `checkpoint_in_tiles` under activation offload: smaller tiles cost step time (smaller
# grouped GEMMs, more launches) for the same peak, which an attention layer's backward sets
# (docs/activation_offload.md; BENCHMARKS.md's memory table).
OFFLOAD_TILE_TOKENS = 16384


def checkpoint_in_tiles(layer: nn.Module, tile_tokens: int) -> None:
    """Activation checkpointing inside decoder layer `layer` instead of around it: the attention mixer
    (or a dense MLP) is one unit, the GatedDeltaNet and the MoE block run in token tiles of at most
    `tile_tokens`, each a unit (the GatedDeltaNet carries its state across tiles; under SP or EP they
    are one unit). The norms between them save their outputs as usual. Backward then holds one
    tile's recompute where per-layer checkpointing holds the whole layer's (at 32K tokens: the
    GatedDeltaNet's saved tensors while the MoE's backward runs)."""
    if tile_tokens <= 0:
        raise ValueError(f"checkpoint tile of {tile_tokens} tokens; it must be > 0")
    mixer = getattr(layer, "linear_attn", None)
    if mixer is not None:
        mixer.checkpoint_tile_tokens = tile_tokens
    else:
        activation_checkpoint(layer.self_attn)
    if isinstance(layer.mlp, MoeBlock):
        layer.mlp.checkpoint_tile_tokens = tile_tokens
    else:
        activation_checkpoint(layer.mlp)


def checkpoint_decoder_layer(layer: nn.Module, tile_tokens: int = 0) -> None:
    """Activation checkpointing of decoder layer `layer`: around it (tile_tokens 0), or inside it in
    token tiles (`checkpoint_in_tiles`)."""
    if tile_tokens:
        checkpoint_in_tiles(layer, tile_tokens)
    else:
        activation_checkpoint(layer)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a MoeCausalLM (`model.layers`) or a MoeVisionLM (`model.language_model.layers`)."""
    inner = model.model
    return inner.layers if hasattr(inner, "layers") else inner.language_model.layers


def mtp_layers(model: nn.Module) -> nn.ModuleList | list:
    """The MTP module's decoder layers (`mtp.layers`), or [] for a model without MTP layers."""
    mtp = getattr(model, "mtp", None)
    return [] if mtp is None else mtp.layers


def input_embedding(model: nn.Module) -> nn.Embedding:
    """embed_tokens of a MoeCausalLM (`model.embed_tokens`) or a MoeVisionLM (`model.language_model.embed_tokens`)."""
    inner = model.model
    return inner.embed_tokens if hasattr(inner, "embed_tokens") else inner.language_model.embed_tokens


def check_tied_embeddings(model: nn.Module) -> None:
    """With tie_word_embeddings, `model.lm_head.weight` must still be the embedding's weight: one
    parameter. FSDP2 keeps a shared parameter shared only inside one unit (a unit holding one of the
    pair replaces that module's weight alone), and `to_empty` / `.to` keep it because DTensor
    parameters are swapped in place. Raises ValueError otherwise; a no-op for an untied model."""
    if model.arch.tie_word_embeddings and model.lm_head.weight is not input_embedding(model).weight:
        raise ValueError(
            "tie_word_embeddings: lm_head.weight is no longer embed_tokens.weight (the pair must share one FSDP unit)"
        )


def decoder_layer_names(model: nn.Module) -> list[str]:
    """The module names of `decoder_layers(model)` in order, as transformers names them:
    "model.layers.<i>" (MoeCausalLM) or "model.language_model.layers.<i>" (MoeVisionLM)."""
    names = {id(m): name for name, m in model.named_modules()}
    return [names[id(m)] for m in decoder_layers(model)]


def offload_activations(model: nn.Module, modules: tuple[str, ...] = (), **options) -> ActivationOffload:
    """Attach activation offload to the decoder layers of `model` that `modules` selects (patterns over
    `decoder_layer_names`; empty = all), before `fully_shard`. `options` go to `ActivationOffload`
    (prefetch_layers, min_bytes)."""
    return ActivationOffload(decoder_layers(model), select_layers(decoder_layer_names(model), modules), **options)


def shard_experts(experts: Experts, group: ExpertParallelGroup, ep_mesh: DeviceMesh) -> None:
    """Replace each expert weight [E, ...] of `experts` by this rank's rows [r*E/ep, (r+1)*E/ep) as a
    DTensor (`Shard(0)` on `ep_mesh`), in place. Raises ValueError unless ep divides E."""
    for name, param in list(experts.named_parameters(recurse=False)):
        if param.shape[0] % group.size:
            raise ValueError(f"{param.shape[0]} experts do not split over expert-parallel size {group.size}")
        local_experts = param.shape[0] // group.size
        local = param.detach()[group.rank * local_experts : (group.rank + 1) * local_experts]
        dtensor = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
        # a frozen weight stays frozen (LoRA's base experts): a new Parameter would require grad
        setattr(experts, name, nn.Parameter(dtensor, requires_grad=param.requires_grad))


def fully_shard_model(root: nn.Module, model: nn.Module, plan: FsdpPlan) -> ActivationOffload | None:
    """Apply `plan` to `model` (a MoeCausalLM or MoeVisionLM) in place, with `root` (the model or a
    module wrapping it) as the root unit: the vision tower's blocks and the tower, routers, then (under
    EP) experts, then each decoder layer (the MTP module's too, then that module), then the root (with a
    tied lm_head and embedding in it: `check_tied_embeddings`). Returns the activation offload (its
    counters) when the plan asks for it."""
    offload = offload_activations(model, plan.activation_offload_modules) if plan.activation_offload else None
    common = dict(
        mesh=plan.mesh,
        reshard_after_forward=plan.reshard_after_forward,
        offload_policy=plan.offload_policy or OffloadPolicy(),
    )
    layer_mp = MixedPrecisionPolicy(param_dtype=plan.compute_dtype, reduce_dtype=plan.reduce_dtype)
    router_mp = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None, cast_forward_inputs=False)
    visual = getattr(model.model, "visual", None)
    if visual is not None:
        for block in visual.blocks:
            if plan.activation_checkpointing:
                activation_checkpoint(block)
            fully_shard(block, mp_policy=layer_mp, **common)
        fully_shard(visual, mp_policy=layer_mp, **common)
        model.set_tower_every_forward(True)
    for layer in [*decoder_layers(model), *mtp_layers(model)]:
        for sub in layer.modules():
            if isinstance(sub, TopKRouter):
                fully_shard(sub, mp_policy=router_mp, **common)
        if plan.experts is not None:
            ep = plan.experts
            for experts in [m for m in layer.modules() if isinstance(m, Experts)]:
                shard_experts(experts, ep.group, ep.ep_mesh)
                fully_shard(
                    experts,
                    **{**common, "mesh": ep.fsdp_mesh},
                    mp_policy=layer_mp,
                    shard_placement_fn=lambda _param: Shard(1),
                )
        if plan.activation_checkpointing:
            checkpoint_decoder_layer(layer, plan.checkpoint_tile_tokens)
        fully_shard(layer, mp_policy=layer_mp, **common)
    if mtp_layers(model):
        fully_shard(model.mtp, mp_policy=layer_mp, **common)
    root_mp = MixedPrecisionPolicy(
        param_dtype=plan.compute_dtype, reduce_dtype=plan.reduce_dtype, cast_forward_inputs=False
    )
    fully_shard(root, mp_policy=root_mp, **common)
    check_tied_embeddings(model)
    return offload
