"""`MoeEngineBase`: verl's BaseEngine contract for our Qwen3.5-MoE / Qwen3-MoE spec, written once.

Both engines (`engines/fsdp2.py`, `engines/veomni.py`) are this class plus what differs between them:
the parallel layout (`_build_parallel_layout`: meshes, data-parallel group, Ulysses and expert groups),
how the experts shard (`_expert_plan`, for `models/fsdp_plan.py`), the optimizer and the LR schedule.
Everything else is here, in verl's method order: build (spec on the meta device, sharded, weights
broadcast from rank 0), train / eval contexts, optimizer and schedule steps, the micro-batch loop with
the loss call (`forward_backward_batch`), weights out (`engines/export.py`), placement and checkpoints
(`engines/checkpoint.py`).

One micro-batch: `batch.split_micro_batches` -> `batch.pack_micro_batch` -> `logprob_model.packed_log_probs`
(the spec and the fused log-prob head, Ulysses-sliced under SP) -> verl's `loss_function` (plus the MTP
loss under verl's `model.mtp.enable_train`: `engines/mtp_loss.py`) -> backward.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor
from verl.utils import tensordict_utils as tu
from verl.workers.engine.base import BaseEngine, BaseEngineCtx
from verl.workers.engine.utils import postprocess_batch_func
from verl_moe.engines import batch, export, mtp_loss, router_replay
from verl_moe.engines import checkpoint as ckpt
from verl_moe.engines.config import (
    engine_layout,
    lora_merge,
    lora_settings,
    mtp_loss_scale,
    mtp_switches,
    ops_config,
    precision_dtypes,
    validate_engine_config,
    vision_switch,
)
from verl_moe.engines.logprob_model import LogProbModel, packed_log_probs
from verl_moe.engines.offload import move_module, move_optimizer_state
from verl_moe.engines.value_model import ValueModel, check_value_model_config, is_value_role, packed_values
from verl_moe.models import build, from_pretrained, lora
from verl_moe.models.fsdp_plan import (
    OFFLOAD_TILE_TOKENS,
    ExpertPlan,
    FsdpPlan,
    check_tied_embeddings,
    fully_shard_model,
)
from verl_moe.models.value_head import add_value_head, value_from_pretrained
from verl_moe.ops import device
from verl_moe.ops.common import runtime

logger = logging.getLogger(__name__)


class _ModeCtx(BaseEngineCtx):
    """verl's load/offload context plus module.train()/eval()."""

    def __enter__(self):
        super().__enter__()
        self.engine.module.train(self.mode == "train")

    def __exit__(self, exc_type, exc_val, exc_tb):
        if self.mode == "train" and (self.zero_grad_on_exit or exc_type is not None):
            self.engine.optimizer_zero_grad()
        super().__exit__(exc_type, exc_val, exc_tb)


class MoeEngineBase(BaseEngine):
    """verl engine for the model types of `verl_moe.models.SPECS` (a subclass is selected by
    `engines/selector.py`).

    Args (as verl passes them): model_config (HFModelConfig), engine_config, optimizer_config,
    checkpoint_config (CheckpointConfig or None); see each subclass for the config classes it takes.
    Raises ValueError on an unsupported configuration before anything is built.
    """

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        super().__init__()
        world_size = dist.get_world_size()
        validate_engine_config(model_config, engine_config, world_size)
        # verl's critic (role value_model): the spec with a value head, values instead of log-probs
        self.value_head = is_value_role(model_config)
        if self.value_head:
            check_value_model_config(model_config, engine_config)
        if engine_config.full_determinism:
            enable_determinism(engine_config.seed)
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.layout = engine_layout(engine_config, model_config)
        self.lora = lora_settings(model_config)  # None: no LoRA
        self.mtp_loss_scale = mtp_loss_scale(model_config)  # 0.0: no MTP loss (verl's model.mtp)
        self.mode = None
        self.rank = dist.get_rank()
        self.device = device.current_device()
        self.master_dtype, self.compute_dtype, self.reduce_dtype = precision_dtypes(engine_config)
        self._build_parallel_layout(world_size)
        self.module: LogProbModel | None = None
        self.router_replay: router_replay.RouterReplay | None = None  # engine.router_replay R2 / R3
        self.optimizer = None
        self.lr_scheduler = None
        self.last_step_skipped = False
        self._saved_checkpoints: list[str] = []
        # per parameter, this rank's shard as last exported (verl's delta sync diffs against it);
        # the attribute is verl's: BaseEngine.prime_delta_snapshots fills it after the seed sync
        self._delta_shard_snap: dict[str, torch.Tensor] = {}

    # ---- what a subclass gives ----------------------------------------------------------------

    def _build_parallel_layout(self, world_size: int) -> None:
        """Set `mesh` (what FSDP shards over), `dp_group` / `dp_rank`, `sequence_parallel` (a
        `models.process_groups.UlyssesGroup` or None) and `expert_parallel` (an `ExpertParallelGroup` or None)."""
        raise NotImplementedError

    def _expert_plan(self) -> ExpertPlan | None:
        """How the experts shard (`models/fsdp_plan.py`); None: with their decoder layer."""
        raise NotImplementedError

    def _build_optimizer(self, module: torch.nn.Module) -> torch.optim.Optimizer:
        raise NotImplementedError

    def _build_lr_scheduler(self, optimizer):
        raise NotImplementedError

    # ---- build -------------------------------------------------------------------------------

    def initialize(self):
        """Build the sharded model (weights from `model_config.local_path`), optimizer and LR schedule."""
        from verl_moe.ops.logprob import logprob_head

        ops = ops_config(self.engine_config)
        # ops are chosen for the compute dtype (fp32 master weights compute in bf16 under mixed
        # precision); a vision-language config builds the whole model (tower + text decoder) unless
        # `text_only` asks for the decoder alone
        text_only = vision_switch(self.engine_config, "text_only")
        picks = {"ops": ops, "compute_dtype": self.compute_dtype, "text_only": text_only}
        model = build(self.model_config.hf_config, dtype=self.master_dtype, device="meta", **picks)
        if vision_switch(self.engine_config, "freeze_vision_tower") and hasattr(model.model, "visual"):
            model.model.visual.requires_grad_(False)  # before sharding: FSDP keeps the flag per shard
        if self.lora is not None:  # adapters added and the base frozen before sharding, as the tower above
            lora.apply_lora(model, self.lora)
        model.set_sequence_parallel(self.sequence_parallel)
        model.set_expert_parallel(self.expert_parallel)
        if self.value_head:
            add_value_head(model)  # lm_head swapped for the value head (models/value_head.py)
            module = ValueModel(model)
        else:
            head = logprob_head(ops.impl("logprob"))  # resolved once, as the model's ops
            module = LogProbModel(model, head, mtp_detach=mtp_switches(self.model_config)[3])
        self._shard(module)
        module.to_empty(device=self.device)
        check_tied_embeddings(module.model)  # a tied lm_head still shares the embedding's weight
        full_state = {}
        if self.rank == 0 and self.value_head:
            # the head from the folder (a value checkpoint) or drawn from the engine seed (a causal LM's)
            full_state = value_from_pretrained(
                self.model_config.local_path,
                self.model_config.hf_config,
                self.engine_config.seed,
                dtype=self.master_dtype,
                device="cpu",
                **picks,
            ).state_dict()
        elif self.rank == 0:
            # built from verl's config, not the folder's: verl zeroes its MTP layers unless model.mtp.enable
            full_state = from_pretrained(
                self.model_config.local_path,
                dtype=self.master_dtype,
                device="cpu",
                config=self.model_config.hf_config,
                **picks,
            )
            if self.lora is not None:
                # rank 0 draws the A factors (broadcast with the weights) from the engine seed: any layout
                # of the same config starts from the same adapters
                seeded = torch.Generator().manual_seed(self.engine_config.seed)
                lora.apply_lora(full_state, self.lora, generator=seeded)
            full_state = full_state.state_dict()
        set_model_state_dict(
            module.model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        )
        del full_state
        self.module = module
        if self.engine_config.router_replay.mode != "disabled":
            self.router_replay = router_replay.RouterReplay(model)
        if not self.engine_config.forward_only:
            self.optimizer = self._build_optimizer(module)
            self.lr_scheduler = self._build_lr_scheduler(self.optimizer)
        self.to(
            "cpu",
            model=self.is_param_offload_enabled,
            optimizer=self.is_optimizer_offload_enabled,
            grad=self.is_param_offload_enabled,
        )

    def _shard(self, module: LogProbModel) -> None:
        """fully_shard as `models/fsdp_plan.py` lays the model out, with this engine's mesh and dtypes."""
        layout = self.layout
        offload = CPUOffloadPolicy(pin_memory=device.is_accelerator()) if layout.fsdp_cpu_offload else OffloadPolicy()
        plan = FsdpPlan(
            mesh=self.mesh,
            compute_dtype=None if self.compute_dtype == self.master_dtype else self.compute_dtype,
            reduce_dtype=None if self.reduce_dtype == self.master_dtype else self.reduce_dtype,
            reshard_after_forward=layout.reshard_after_forward,
            offload_policy=offload,
            activation_checkpointing=self.model_config.enable_gradient_checkpointing,
            experts=self._expert_plan(),
            activation_offload=layout.activation_offload,
            activation_offload_modules=layout.activation_offload_modules,
            # offload moves the checkpoint units' inputs to the host: units inside the layer then cost no
            # device memory and cut what one layer's backward holds
            checkpoint_tile_tokens=OFFLOAD_TILE_TOKENS if layout.activation_offload else 0,
        )
        # the activation offload's counters (host bytes, tensors packed), or None
        self.activation_offload = fully_shard_model(module, module.model, plan)

    @property
    def is_param_offload_enabled(self) -> bool:
        return self.engine_config.param_offload

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return self.engine_config.optimizer_offload

    def train_mode(self, **kwargs):
        return _ModeCtx(self, mode="train", **kwargs)

    def eval_mode(self, **kwargs):
        return _ModeCtx(self, mode="eval", **kwargs)

    # ---- steps -------------------------------------------------------------------------------

    def optimizer_zero_grad(self):
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> float:
        """Clip to `optimizer_config.clip_grad` and step; skip the step (and zero the gradients)
        when the gradient norm is not finite. Returns the norm before clipping."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        grad_norm = total_grad_norm(grads)
        self.last_step_skipped = not math.isfinite(grad_norm)
        if self.last_step_skipped:
            logger.warning("verl_moe: non-finite grad norm %s, optimizer step skipped", grad_norm)
            self.optimizer.zero_grad(set_to_none=True)
            return grad_norm
        clip = self.optimizer_config.clip_grad
        coef = clip / (grad_norm + 1e-6)
        if coef < 1.0:
            scale_grads_(grads, coef)
        self.optimizer.step()
        return grad_norm

    def lr_scheduler_step(self) -> float:
        self.lr_scheduler.step()
        return self.lr_scheduler.get_last_lr()[0]

    def forward_backward_batch(self, data: TensorDict, loss_function: Callable | None, forward_only=False) -> dict:
        """Micro-batch `data`, run the spec + log-prob head, call `loss_function`, backward.

        Returns {"model_output": {"log_probs", "entropy"?: nested [N, j], "routed_experts"?: nested
        [N, j, L, TOPK] int16 (router_replay R2, forward only: `engines/router_replay.py`)} (in `data`'s
        order; empty when training unless `return_model_output`), "loss": [float per micro-batch],
        "metrics": {key: [value per micro-batch]}}.
        """
        # verl's fix for 4-row position ids whose ragged dim a pickle / chunk lost (its train_batch
        # and infer_batch call it; ours overrides train_batch)
        start = time.perf_counter()
        tu.maybe_fix_3d_position_ids(data)
        batch.check_batch_options(data)
        dp_group = self.get_data_parallel_group()
        tu.assign_non_tensor(
            data, batch_num_tokens=batch.global_token_count(data, dp_group), dp_size=self.get_data_parallel_size()
        )
        calculate_entropy = bool(tu.get_non_tensor_data(data, "calculate_entropy", False))
        keep_output = forward_only or bool(tu.get_non_tensor_data(data, "return_model_output", False))
        # the batch's switches (verl's TrainingWorker always sets them), else this engine's config
        ec, sp = self.engine_config, self.layout.sequence_parallel_size
        if forward_only:
            default_size, default_tokens = ec.infer_micro_batch_size_per_gpu, ec.infer_max_token_len_per_gpu
        else:
            default_size, default_tokens = ec.micro_batch_size_per_gpu, ec.max_token_len_per_gpu
        max_token_len = tu.get_non_tensor_data(data, "max_token_len_per_gpu", default_tokens)
        lengths = data["input_ids"].offsets().diff().tolist()
        indices = batch.split_micro_batches(
            lengths,
            use_dynamic_bsz=bool(tu.get_non_tensor_data(data, "use_dynamic_bsz", ec.use_dynamic_bsz)),
            micro_batch_size=tu.get_non_tensor_data(data, "micro_batch_size_per_gpu", default_size),
            # an SP group shares one micro-batch over its ranks: verl's budget is per rank
            max_token_len=None if max_token_len is None else max_token_len * sp,
            dp_group=dp_group,
        )
        defer_sync = self.layout.defer_grad_sync
        # R2 records the routing of a forward-only pass, replays it in training; R3 always replays
        replay_action = router_replay.step_action(self.engine_config.router_replay.mode, data, forward_only)
        mtp = None  # the MTP loss's mini-batch counts, when training with it
        if self.mtp_loss_scale and not forward_only and loss_function is not None:
            depth = self.module.model.arch.mtp_num_hidden_layers
            mtp = mtp_loss.batch_mtp_loss(data, depth, self.mtp_loss_scale, dp_group, self.get_data_parallel_size())
        outputs = []
        for i, micro_indices in enumerate(indices):
            micro_batch = batch.select_micro_batch(data, micro_indices)
            # packed from the host copy: its sequence boundaries and temperatures are read there
            packed = batch.pack_micro_batch(micro_batch, self.device)
            micro_batch = micro_batch.to(self.device)
            if not forward_only:
                self.module.set_requires_gradient_sync(i == len(indices) - 1 or not defer_sync)
            routing = nullcontext()
            if replay_action is not None:
                routing = self.router_replay.armed(replay_action, micro_batch, packed, self.sequence_parallel)
            mtp_targets = None if mtp is None else mtp_loss.micro_batch_targets(micro_batch, packed, mtp.depth)
            with routing:
                if self.value_head:  # verl's critic: {"values": nested [N, j]}, read by verl's value_loss
                    values = packed_values(self.module, packed, self.sequence_parallel)
                    model_output, mtp_ce = {"values": batch.unpack_to_nested(values, packed)}, None
                else:
                    log_probs, entropy, mtp_ce = packed_log_probs(
                        self.module, packed, self.sequence_parallel, calculate_entropy, not forward_only, mtp_targets
                    )
                    model_output = {"log_probs": batch.unpack_to_nested(log_probs, packed)}
                    if entropy is not None:
                        model_output["entropy"] = batch.unpack_to_nested(entropy, packed)
                loss, metrics = None, {}
                if loss_function is not None:
                    loss, metrics = loss_function(model_output=model_output, data=micro_batch, dp_group=dp_group)
                if mtp_ce is not None:
                    loss = loss + mtp.term(mtp_ce)
                    metrics = {**metrics, "mtp_loss": mtp_loss.micro_batch_mean(mtp_ce, mtp_targets[1])}
                if not forward_only:
                    if loss is None:
                        raise ValueError("training needs a loss_function")
                    loss.backward()
                if replay_action == router_replay.RECORD:
                    model_output["routed_experts"] = self.router_replay.recorded(packed, self.sequence_parallel)
            outputs.append(
                {
                    "model_output": {k: v.detach() for k, v in model_output.items()} if keep_output else {},
                    "loss": None if loss is None else loss.detach(),
                    "metrics": metrics,
                }
            )
        _read_losses(outputs)
        result = postprocess_batch_func(outputs, indices, data)  # model outputs back in the batch's order
        if logger.isEnabledFor(logging.INFO):
            # the engine's own share of verl's timing_s/old_log_prob, ref and update_actor (the rest is verl's
            # dispatch and TransferQueue); the wait is only for the log line
            device.synchronize()
            logger.info(
                "verl_moe engine: %s of %d sequences (%d tokens, %d micro-batches) in %.3f s",
                "forward" if forward_only else "forward + backward",
                len(lengths),
                sum(lengths),
                len(indices),
                time.perf_counter() - start,
            )
        return result

    def train_batch(self, data: TensorDict, loss_function: Callable) -> dict:
        """One optimizer step on `data`; adds "grad_norm" and "grad_norm_nonfinite" (1.0 = step skipped)."""
        self.optimizer_zero_grad()
        outputs = self.forward_backward_batch(data, loss_function, forward_only=False)
        grad_norm = self.optimizer_step()
        outputs["metrics"]["grad_norm"] = grad_norm
        outputs["metrics"]["grad_norm_nonfinite"] = [float(self.last_step_skipped)]
        return outputs

    # ---- weights out (engines/export.py) -----------------------------------------------------

    def get_per_tensor_param(
        self, layout: str = "vllm", base_sync_done: bool = False, **kwargs
    ) -> tuple[Generator, dict | None]:
        """(generator of (name, full tensor), peft config or None). Every rank must consume it (each tensor
        is all-gathered). layout "vllm": experts split per expert in vLLM's names (what verl's rollout
        loads); "hf": transformers names with fused experts. A tied lm_head is left out.

        With LoRA, as verl's FSDP engine: `model_config.lora.merge` -> base + scale * B A under the base
        names, None; else the adapters under peft's names (`base_sync_done`, what verl's rollout sync
        asks for once the base is loaded) or the base weights alone, with the peft config (a dict).
        `layered_summon` is accepted and ignored (tensors are gathered one at a time anyway)."""
        if layout not in export.LAYOUTS:
            raise ValueError(f"layout must be 'vllm' or 'hf', got {layout!r}")
        model = self.module.model
        merge = self.lora is not None and lora_merge(self.model_config)
        adapters_only = self.lora is not None and not merge and base_sync_done

        def full_tensors():
            with self._params_on_device():
                if adapters_only:
                    yield from export.adapter_named_tensors(model)
                else:
                    yield from export.per_tensor_params(model, layout, merge_lora=merge)

        peft_config = None
        if self.lora is not None and not merge:
            peft_config = lora.peft_config_dict(self.lora, model)
        return full_tensors(), peft_config

    def disable_adapter(self):
        """verl's context for the base model's forward under LoRA (reference log-probs of a LoRA actor,
        `no_lora_adapter`); a plain context without LoRA."""
        return lora.adapters_disabled(self.module.model)

    def get_per_tensor_param_shard(self, **kwargs) -> tuple[Generator, None]:
        """(generator of (transformers name, this rank's local shard flat in bf16, verl `ShardSpec`), None)
        for verl's sharded delta checkpoint engine (`export.local_shards`). Raises ValueError under LoRA
        (the shards are the base weights: use a full-tensor checkpoint engine)."""
        if self.lora is not None:
            raise ValueError(
                "the sharded delta weight sync (checkpoint_engine delta_sharded) is not supported with LoRA "
                "(lora_rank > 0); use a full-tensor checkpoint engine (naive, nccl)"
            )

        def shards():
            with self._params_on_device():
                yield from export.local_shards(self.module.model)

        return shards(), None

    def get_per_tensor_param_delta_shard(self, **kwargs) -> tuple[Generator, None]:
        """verl's delta export: per parameter, the elements changed since the last export (or since
        `prime_delta_snapshots`) in vLLM's names and coordinates (`export.vllm_delta_entry`)."""
        gen, _ = self.get_per_tensor_param_shard()
        return export.delta_entries(gen, self._delta_shard_snap), None

    # ---- parallel layout ---------------------------------------------------------------------

    def get_data_parallel_size(self):
        """Ranks holding different data: the world over the sequence-parallel size."""
        return dist.get_world_size() // self.layout.sequence_parallel_size

    def get_data_parallel_rank(self):
        return self.dp_rank

    def get_data_parallel_group(self):
        return self.dp_group

    # ---- placement and checkpoints -----------------------------------------------------------

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        """Move sharded parameters (with their gradients) and/or optimizer state to `device`
        ("cpu" or this process's accelerator type)."""
        super().to(device=device, model=model, optimizer=optimizer, grad=grad)
        target = torch.device("cpu") if device == "cpu" else self.device
        if device not in ("cpu", self.device.type):
            raise ValueError(f"device must be 'cpu' or {self.device.type!r}, got {device!r}")
        if self.layout.fsdp_cpu_offload:
            return  # FSDP2's CPUOffloadPolicy owns parameter placement
        if model:
            move_module(self.module, target)
        if optimizer and self.optimizer is not None:
            move_optimizer_state(self.optimizer, target)

    @contextmanager
    def _params_on_device(self, optimizer: bool = False):
        """Parameters (and optimizer state) on the compute device for the duration, so every
        state_dict / collective sees one device; offloaded placement is restored afterwards."""
        offloaded_model = self.is_param_offload_enabled and not self.layout.fsdp_cpu_offload
        offloaded_optim = optimizer and self.is_optimizer_offload_enabled
        if offloaded_model or offloaded_optim:
            self.to(self.device.type, model=offloaded_model, optimizer=offloaded_optim, grad=offloaded_model)
        try:
            yield
        finally:
            if offloaded_model or offloaded_optim:
                self.to("cpu", model=offloaded_model, optimizer=offloaded_optim, grad=offloaded_model)

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        """Model, optimizer, LR schedule and RNG via torch.distributed.checkpoint, written to
        `<local_path>.tmp` and renamed when complete (`engines/checkpoint.py`: a kill at any
        instant keeps a loadable checkpoint); an HF safetensors export when
        `checkpoint_config.save_contents` holds "hf_model". `max_ckpt_to_keep` counts distinct
        paths: saving to a path again makes it the newest, and the path just saved is never pruned."""
        if hdfs_path is not None:
            raise ValueError(f"hdfs_path is not supported by {type(self).__name__}; copy local_path yourself")
        contents = ckpt.checkpoint_contents(self.checkpoint_config, "save")
        with self._params_on_device(optimizer=True):
            path = ckpt.save(
                local_path,
                model=self.module.model,
                optimizer=self.optimizer if "optimizer" in contents else None,
                lr_scheduler=self.lr_scheduler if "extra" in contents else None,
                global_step=global_step,
                hf_export="hf_model" in contents,
            )
        self._saved_checkpoints = [p for p in self._saved_checkpoints if p != path] + [path]
        if max_ckpt_to_keep:
            self._saved_checkpoints = ckpt.prune(self._saved_checkpoints, max_ckpt_to_keep)

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        """Restore what `save_checkpoint` wrote: model and optimizer on any world size, LR schedule
        and RNG ("extra") on the same one. Every rank checks its files first; on a problem all
        raise `ckpt.CheckpointError` (a ValueError; `CheckpointNotFoundError` for a missing file)
        before anything is restored. `del_local_after_load` is accepted for verl's signature and
        ignored (local checkpoints are never deleted)."""
        if hdfs_path is not None:
            raise ValueError(f"hdfs_path is not supported by {type(self).__name__}")
        contents = ckpt.checkpoint_contents(self.checkpoint_config, "load")
        with self._params_on_device(optimizer=True):
            ckpt.load(
                local_path,
                model=self.module.model,
                optimizer=self.optimizer if "optimizer" in contents else None,
                lr_scheduler=self.lr_scheduler if "extra" in contents else None,
            )

    def is_mp_src_rank_with_outputs(self):
        """True on the first rank of each sequence-parallel group (every rank without SP): the ranks
        of one group hold the same gathered outputs, and verl collects one copy per data-parallel rank."""
        return self.sequence_parallel is None or self.sequence_parallel.rank == 0


def _read_losses(outputs: list[dict]) -> None:
    """Each micro-batch's "loss" (a device scalar, or None) as a float, read back in one go after the last
    micro-batch: a read per micro-batch would hold the host until that micro-batch's backward had run, and the
    device would wait while the next one is packed."""
    losses = [o["loss"].float() for o in outputs if o["loss"] is not None]
    values = iter(torch.stack(losses).tolist() if losses else [])
    for o in outputs:
        o["loss"] = 0.0 if o["loss"] is None else next(values)


def trainable_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer steps: those that require a gradient (a frozen vision tower's do not)."""
    return [p for p in module.parameters() if p.requires_grad]


def enable_determinism(seed: int) -> None:
    """verl's `full_determinism`: verl's own switches (seeds, deterministic torch algorithms,
    cuBLAS workspace, NCCL / HCCL settings), plus our kernels' fixed configs (`ops/common/runtime.py`),
    so two processes given the same inputs produce the same bits."""
    from verl.workers.engine.utils import enable_full_determinism

    enable_full_determinism(seed=seed)
    runtime.set_deterministic(True)


def _grouped_by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors grouped by DTensor mesh (plain tensors together): fused foreach ops and norms
    refuse DTensors of different meshes (expert-parallel weights live on their own mesh)."""
    groups: dict = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(groups.values())


def total_grad_norm(grads: list[torch.Tensor]) -> float:
    """The L2 norm over every gradient (sharded DTensors reduced over their mesh); may be inf/nan."""
    squares = []
    for group in _grouped_by_mesh(grads):
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0, error_if_nonfinite=False)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.to(torch.float64) ** 2)
    return float(torch.stack(squares).sum().sqrt()) if squares else 0.0


def scale_grads_(grads: list[torch.Tensor], factor: float) -> None:
    """Multiply every gradient in place by a Python scalar (DTensors refuse a plain-tensor factor)."""
    for group in _grouped_by_mesh(grads):
        torch._foreach_mul_(group, factor)
