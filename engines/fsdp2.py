"""`MoeFsdp2Engine`: verl's BaseEngine for Qwen3.5-MoE / Qwen3-MoE on FSDP2 `fully_shard`.

Parallelism: one DeviceMesh over the world, 1-D ("fsdp") or, when `fsdp_size` is smaller than
the world, 2-D ("ddp", "fsdp") = hybrid shard (replicate across groups, shard within). The
units are `models/fsdp_plan.py`'s: each decoder layer (activation checkpointing when the model
config asks for it), each MoE router in the master dtype (fp32), and the root (embeddings, final
norm, lm_head), which wraps the fused log-prob head (`logprob_model.LogProbModel`) so the head sees
unsharded weights.

Ulysses sequence parallelism (`ulysses_sequence_parallel_size` = sp > 1): a second ("dp", "sp")
mesh groups consecutive ranks into SP groups that share one batch (verl dispatches by the dp
rank, and collects from SP rank 0). FSDP still shards over every rank, as verl's FSDP engine
does: the ranks of an SP group need the same parameters anyway, so sharding over dp only would
just hold sp copies. Each rank runs its slice of every packed micro-batch (`engines/batch.py`)
and gathers the per-token log-probs, so all SP ranks compute the same loss; the gather's
backward sums the sp identical gradients, and FSDP's average over dp x sp ranks turns that sum
back into exactly the data-parallel gradient.

Weights: every rank builds the spec on the meta device, shards it, allocates its shards, and
rank 0 reads the HF folder and broadcasts (`set_model_state_dict(broadcast_from_rank0=True)`).

Everything but the layout and the optimizer (data path, loss call, micro-batching, metrics, weights
out, checkpoints) is `engines/base.py`'s `MoeEngineBase`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup
from verl.workers.config.optimizer import build_optimizer
from verl_moe.engines.base import MoeEngineBase, trainable_parameters
from verl_moe.models.fsdp_plan import ExpertPlan
from verl_moe.models.process_groups import UlyssesGroup
from verl_moe.ops import device


def build_fsdp_mesh(world_size: int, fsdp_size: int) -> DeviceMesh:
    """1-D ("fsdp",) mesh over the world, or 2-D ("ddp", "fsdp") hybrid shard when fsdp_size < world."""
    if fsdp_size == -1 or fsdp_size >= world_size:
        return init_device_mesh(device.device_type(), (world_size,), mesh_dim_names=("fsdp",))
    return init_device_mesh(device.device_type(), (world_size // fsdp_size, fsdp_size), mesh_dim_names=("ddp", "fsdp"))


def build_data_sequence_mesh(world_size: int, sp: int) -> tuple[dist.ProcessGroup, int, UlyssesGroup | None]:
    """(data-parallel group, data-parallel rank, Ulysses group or None) of a ("dp", "sp") layout:
    consecutive ranks form one SP group (as in verl's FSDP engine); with sp == 1 the data-parallel
    group is the world and no extra mesh is built."""
    if sp == 1:
        return dist.group.WORLD, dist.get_rank(), None
    mesh = init_device_mesh(device.device_type(), (world_size // sp, sp), mesh_dim_names=("dp", "sp"))
    group = UlyssesGroup(group=mesh["sp"].get_group(), size=sp, rank=mesh["sp"].get_local_rank())
    return mesh["dp"].get_group(), mesh["dp"].get_local_rank(), group


class MoeFsdp2Engine(MoeEngineBase):
    """verl engine for `model_engine=fsdp` / `fsdp2` and the model types of `verl_moe.models.SPECS`.

    Args (as verl passes them): model_config (HFModelConfig), engine_config (verl's
    FSDPEngineConfig or our MoeFsdp2EngineConfig), optimizer_config (FSDPOptimizerConfig),
    checkpoint_config (CheckpointConfig or None). Raises ValueError on an unsupported
    configuration before anything is built.
    """

    def _build_parallel_layout(self, world_size: int) -> None:
        """Set `mesh` (what FSDP shards over), the data-parallel group and rank, and the Ulysses
        group (None without SP); this engine has no expert parallelism."""
        self.mesh = build_fsdp_mesh(world_size, self.layout.fsdp_size)
        self.dp_group, self.dp_rank, self.sequence_parallel = build_data_sequence_mesh(
            world_size, self.layout.sequence_parallel_size
        )
        self.expert_parallel = None

    def _expert_plan(self) -> ExpertPlan | None:
        """Without expert parallelism the experts are sharded with their decoder layer."""
        return None

    def _build_optimizer(self, module: torch.nn.Module) -> torch.optim.Optimizer:
        return build_optimizer(trainable_parameters(module), self.optimizer_config)

    def _build_lr_scheduler(self, optimizer):
        oc = self.optimizer_config
        warmup = oc.lr_warmup_steps
        if warmup is None or warmup <= 0:
            warmup = int(oc.lr_warmup_steps_ratio * oc.total_training_steps)
        if oc.lr_scheduler_type == "constant":
            return get_constant_schedule_with_warmup(optimizer=optimizer, num_warmup_steps=warmup)
        if oc.lr_scheduler_type == "cosine":
            return get_cosine_schedule_with_warmup(
                optimizer=optimizer,
                num_warmup_steps=warmup,
                num_training_steps=oc.total_training_steps,
                min_lr_ratio=oc.min_lr_ratio,
                num_cycles=oc.num_cycles,
                zero_indexed_step=oc.zero_indexed_step,
            )
        raise ValueError(f"lr_scheduler_type {oc.lr_scheduler_type!r}: expected constant or cosine")
