"""`MoeVeOmniEngine`: verl's BaseEngine for `model_engine=veomni` on our Qwen3.5-MoE / Qwen3-MoE
spec, laid out by VeOmni's parallel state.

A sibling of `MoeFsdp2Engine`: both are `engines/base.py`'s `MoeEngineBase` (data path, loss call,
micro-batching, router in fp32, weights out, checkpoints); they differ in three things:

- Layout: VeOmni's `init_parallel_state` builds the meshes from verl's `VeOmniEngineConfig`
  the way verl's own VeOmni engine does: dp = world / ulysses_parallel_size, split into
  dp_replicate x dp_shard by `fsdp_size`; FSDP shards over dp_shard x ulysses ("dp_shard_sp"),
  replicated over dp_replicate (hybrid shard); Ulysses groups are consecutive ranks.
- Expert parallelism (`expert_parallel_size` = ep > 1): VeOmni's expert mesh
  ([ep_replicate,] ep_fsdp, ep) over the sharding ranks. Each rank holds the routed experts
  [r*E/ep, (r+1)*E/ep) of every MoE layer as DTensors (Shard(0) over "ep"), FSDP shards them
  over "ep_fsdp" along dim 1 (as VeOmni does), and token copies reach their experts through
  two all-to-alls (`ops/experts/expert_parallel.py`). An expert's gradient sums the
  contributions of its whole EP group's tokens, so backward scales it by 1/ep: FSDP's average
  over the remaining ranks then gives the world average every other parameter gets.
- Optimizer and schedule: verl's `VeOmniOptimizerConfig` (AdamW, every parameter decayed as in
  VeOmni's `build_optimizer`; its per-tensor update under EP, since fused updates refuse
  DTensors of two meshes) and VeOmni's `build_lr_scheduler`.
"""

from __future__ import annotations

import torch
from veomni.distributed import parallel_state as veomni_parallel_state
from veomni.optim import build_lr_scheduler
from verl.workers.config import VeOmniOptimizerConfig
from verl_moe.engines.base import MoeEngineBase, trainable_parameters
from verl_moe.models.fsdp_plan import ExpertPlan
from verl_moe.models.process_groups import ExpertParallelGroup, UlyssesGroup
from verl_moe.ops import device


def init_veomni_parallel_state(world_size: int, fsdp_size: int, ulysses: int, ep: int):
    """VeOmni's ParallelState for this layout (as verl's VeOmni engine builds it). A state left by
    an earlier process group (tests, restarts) is dropped first: its meshes would be stale."""
    dp = world_size // ulysses
    replicate, shard = (1, dp) if fsdp_size < 0 or fsdp_size >= dp else (dp // fsdp_size, fsdp_size)
    veomni_parallel_state.clear_parallel_state()
    return veomni_parallel_state.init_parallel_state(
        dp_size=dp,
        dp_replicate_size=replicate,
        dp_shard_size=shard,
        ulysses_size=ulysses,
        extra_parallel_sizes=(ep,),
        extra_parallel_names=("ep",),
        dp_mode="fsdp2",
        device_type=device.device_type(),
        name=None,
    )


def check_optimizer_config(optimizer_config) -> None:
    """What a trainable MoeVeOmniEngine builds from: a `VeOmniOptimizerConfig` asking for adamw and a
    constant / linear / cosine schedule. A forward-only engine (verl's reference model, which gets a
    plain `OptimizerConfig()`: verl/workers/config/actor.py) builds no optimizer and skips this.

    Raises: ValueError naming the config class, optimizer or schedule that is not supported.
    """
    if not isinstance(optimizer_config, VeOmniOptimizerConfig):
        raise ValueError(
            f"optimizer config {type(optimizer_config).__name__}: a trainable MoeVeOmniEngine needs "
            "VeOmniOptimizerConfig (actor_rollout_ref.actor.optim of model_engine=veomni)"
        )
    if optimizer_config.optimizer != "adamw":
        raise ValueError(f"optimizer={optimizer_config.optimizer!r}: MoeVeOmniEngine builds adamw only")
    if optimizer_config.lr_scheduler_type not in ("constant", "linear", "cosine"):
        raise ValueError(
            f"lr_scheduler_type {optimizer_config.lr_scheduler_type!r}: expected constant, linear or cosine"
        )


class MoeVeOmniEngine(MoeEngineBase):
    """verl engine for `model_engine=veomni` and the model types of `verl_moe.models.SPECS`.

    Args (as verl passes them): model_config (HFModelConfig), engine_config (verl's
    VeOmniEngineConfig or our MoeVeOmniEngineConfig), optimizer_config (VeOmniOptimizerConfig;
    ignored, and any OptimizerConfig or None accepted, when engine_config.forward_only),
    checkpoint_config (CheckpointConfig or None). Raises ValueError on an unsupported
    configuration before anything is built.
    """

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        if not engine_config.forward_only:  # checked before any process group or mesh is built
            check_optimizer_config(optimizer_config)
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)

    def _build_parallel_layout(self, world_size: int) -> None:
        layout = self.layout
        ps = init_veomni_parallel_state(
            world_size, layout.fsdp_size, layout.sequence_parallel_size, layout.expert_parallel_size
        )
        self.parallel_state = ps
        self.mesh = ps.fsdp_mesh
        self.dp_group, self.dp_rank = ps.dp_group, ps.dp_rank
        self.sequence_parallel = (
            UlyssesGroup(group=ps.ulysses_group, size=ps.ulysses_size, rank=ps.ulysses_rank)
            if ps.ulysses_enabled
            else None
        )
        self.expert_parallel = None
        if ps.ep_enabled:
            ep_mesh = ps.ep_mesh
            # FSDP averages expert gradients over the expert-sharding ranks only (world / ep), and
            # each already sums its EP group's tokens: 1/ep more is the world average every other
            # gradient gets (applied in backward: gloo has no pre-multiplied reduce-scatter)
            self.expert_parallel = ExpertParallelGroup(
                group=ep_mesh.get_group(),
                size=ep_mesh.size(),
                rank=ep_mesh.get_local_rank(),
                weight_grad_scale=1.0 / ep_mesh.size(),
            )

    def _expert_plan(self) -> ExpertPlan | None:
        """Under EP: this rank's expert block as DTensors on the "ep" mesh, sharded by FSDP over the
        remaining expert-mesh dims ([ep_replicate,] ep_fsdp), averaged over the whole world."""
        if self.expert_parallel is None:
            return None
        ps = self.parallel_state
        expert_mesh = ps.extra_parallel_fsdp_device_mesh["ep"]  # ([ep_replicate,] ep_fsdp, ep)
        fsdp_mesh = expert_mesh[expert_mesh.mesh_dim_names[:-1]]
        return ExpertPlan(group=self.expert_parallel, ep_mesh=ps.ep_mesh, fsdp_mesh=fsdp_mesh)

    def _build_optimizer(self, module: torch.nn.Module) -> torch.optim.Optimizer:
        oc = self.optimizer_config
        return torch.optim.AdamW(
            trainable_parameters(module),
            lr=oc.lr,
            betas=tuple(oc.betas),
            weight_decay=oc.weight_decay,
            foreach=self.expert_parallel is None,
        )

    def _build_lr_scheduler(self, optimizer):
        oc = self.optimizer_config
        return build_lr_scheduler(
            optimizer,
            train_steps=oc.total_training_steps,
            lr=oc.lr,
            lr_min=oc.lr_min,
            lr_decay_style=oc.lr_scheduler_type,
            lr_decay_ratio=oc.lr_decay_ratio,
            lr_warmup_ratio=oc.lr_warmup_steps_ratio,
            lr_start=oc.lr_start,
        )
