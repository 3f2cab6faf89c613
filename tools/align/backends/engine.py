"""The `fsdp2` and `veomni` backends: our `MoeFsdp2Engine` / `MoeVeOmniEngine` through verl's
engine contract, one torchrun rank per process (`launch.py` starts them; gloo on CPU). Each batch's
rows split in contiguous blocks over the ranks, as verl dispatches."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from functools import partial

import torch

from ..data import rank_batch
from ..job import Job, TrainSettings, actor_config
from ..trace import BackendTrace, Probe, gather_step_outputs, record_steps, response_values
from .spec import BackendSpec


def fsdp2_unavailable(spec: BackendSpec) -> str | None:
    try:
        from verl_moe.engines import fsdp2  # noqa: F401
    except ImportError as e:
        return f"verl_moe.engines.fsdp2 is not importable: {e}"
    return None


def veomni_unavailable(spec: BackendSpec) -> str | None:
    if importlib.util.find_spec("veomni") is None:  # not imported here: it logs a banner
        return "VeOmni is not installed (pip install --no-deps 'verl-moe[veomni]'; see scripts/install.sh)"
    return None


def engine_configs(backend: str, model_dir: str, engine: dict, optimizer: dict, model: dict | None = None):
    """verl's (HFModelConfig, engine config, optimizer config) of our engine for `backend`
    ("fsdp2" | "veomni") on the HF folder `model_dir`; `engine` / `optimizer` / `model` are the
    fields of MoeFsdp2EngineConfig or MoeVeOmniEngineConfig / FSDPOptimizerConfig or
    VeOmniOptimizerConfig / HFModelConfig (the tokenizer is never loaded)."""
    from verl.workers.config import FSDPOptimizerConfig, HFModelConfig, VeOmniOptimizerConfig
    from verl_moe.engines.config import MoeFsdp2EngineConfig, MoeVeOmniEngineConfig

    classes = {
        "fsdp2": (MoeFsdp2EngineConfig, FSDPOptimizerConfig),
        "veomni": (MoeVeOmniEngineConfig, VeOmniOptimizerConfig),
    }
    if backend not in classes:
        raise ValueError(f"our engines are {list(classes)}, got {backend!r}")
    engine_cls, optimizer_cls = classes[backend]
    model_config = HFModelConfig(path=model_dir, load_tokenizer=False, **(model or {}))
    return model_config, engine_cls(**engine), optimizer_cls(**optimizer)


def build_fsdp2_engine(spec: BackendSpec, model_dir: str, train: TrainSettings, total_steps: int):
    """`MoeFsdp2Engine` for `spec`: fp32 master weights, the spec's compute and router dtypes, fp32
    gradient reduction, AdamW and a constant LR after `train.warmup_steps`."""
    from verl_moe.engines.fsdp2 import MoeFsdp2Engine

    engine = dict(
        strategy="fsdp2",
        model_dtype="fp32",
        mixed_precision={"param_dtype": spec.compute_dtype, "reduce_dtype": "fp32"},
        ops=spec.ops_config(),
        use_dynamic_bsz=False,
        **_replay(spec),
    )
    optimizer = dict(**_adamw(train), lr_warmup_steps=train.warmup_steps, total_training_steps=total_steps)
    return MoeFsdp2Engine(*engine_configs("fsdp2", model_dir, engine, optimizer), checkpoint_config=None)


def build_veomni_engine(spec: BackendSpec, model_dir: str, train: TrainSettings, total_steps: int):
    """`MoeVeOmniEngine` for `spec` (experts over `spec.ep` ranks): as `build_fsdp2_engine`."""
    from verl_moe.engines.veomni import MoeVeOmniEngine

    engine = dict(
        mixed_precision=True,
        param_dtype=spec.compute_dtype,
        expert_parallel_size=spec.ep or 1,
        ops=spec.ops_config(),
        use_dynamic_bsz=False,
        **_replay(spec),
    )
    optimizer = dict(
        **_adamw(train),
        lr_warmup_steps_ratio=train.warmup_steps / max(total_steps, 1),
        total_training_steps=total_steps,
    )
    return MoeVeOmniEngine(*engine_configs("veomni", model_dir, engine, optimizer), checkpoint_config=None)


def _replay(spec: BackendSpec) -> dict:
    """The engine config's router_replay (verl's key) for the spec's replay mode, {} without one."""
    from verl.workers.config import EngineRouterReplayConfig

    return {"router_replay": EngineRouterReplayConfig(mode=spec.replay)} if spec.replay else {}


def _adamw(train: TrainSettings) -> dict:
    return dict(lr=train.lr, weight_decay=train.weight_decay, betas=train.betas, clip_grad=train.clip_grad)


class RouterRecorder:
    """Forward hooks on every `TopKRouter` of a module: the top-k expert ids ([N, TOPK], sorted
    along TOPK) of each router's first call since the last `take()`, in layer order. Later calls
    (activation-checkpoint recomputation in backward) are ignored. A MoE block checkpointed in token
    tiles calls its router once per tile with the tile's rows: the first call of each tile counts."""

    def __init__(self, module: torch.nn.Module):
        from verl_moe.models.layers import TopKRouter

        self.routers = [m for m in module.modules() if isinstance(m, TopKRouter)]
        self.first: dict[int, dict[int, torch.Tensor]] = {}  # id(router) -> first row of a tile -> ids
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]

    def _hook(self, module, args, output):
        _, _, topk_idx = output
        start = args[1].start if len(args) > 1 and args[1] is not None else 0
        self.first.setdefault(id(module), {}).setdefault(start, topk_idx.detach().sort(dim=-1).values.cpu())

    def take(self) -> list[torch.Tensor]:
        out = [torch.cat([tiles[s] for s in sorted(tiles)]) for r in self.routers if (tiles := self.first.get(id(r)))]
        self.first = {}
        return out


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def run_fsdp2_rank(job: Job, spec: BackendSpec, progress: Callable[[int], None]) -> BackendTrace | None:
    return run_engine_rank(job, spec, progress, build_fsdp2_engine)


def run_veomni_rank(job: Job, spec: BackendSpec, progress: Callable[[int], None]) -> BackendTrace | None:
    return run_engine_rank(job, spec, progress, build_veomni_engine)


def run_engine_rank(job: Job, spec: BackendSpec, progress: Callable[[int], None], build) -> BackendTrace | None:
    """One rank of the fsdp2 / veomni backend: verl's engine contract on the engine that
    `build(spec, model_dir, train, total_steps)` makes, batch rows split in contiguous blocks over
    the ranks (as verl dispatches). Returns the trace on rank 0."""
    import torch.distributed as dist
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss
    from verl_moe.ops import device

    if spec.compute_dtype not in ("fp32", "bf16"):
        raise ValueError(f"{spec.label}: our engines compute in fp32 or bf16, not {spec.compute_dtype}")
    dist.init_process_group(backend=device.dist_backend())
    rank, world = dist.get_rank(), dist.get_world_size()
    device.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.manual_seed(0)
    stream = job.stream()
    train = job.train
    engine = build(spec, job.model_dir, train, total_steps=len(stream))
    engine.initialize()
    model = engine.module.model
    params = dict(model.named_parameters())
    probe = Probe({n: p.numel() for n, p in params.items()}, budget=train.probe_budget)
    own_routes = []  # router replay R2: the engine's routes of each batch at θ0, recorded by infer_batch
    if spec.replay == "R2":
        for k, batch in enumerate(stream):
            td = rank_batch(batch, k, rank, world, train.temperature)
            n = batch["input_ids"].shape[0]
            tu.assign_non_tensor(td, use_dynamic_bsz=False, micro_batch_size_per_gpu=n // world)
            with engine.eval_mode():
                own_routes.append(engine.infer_batch(td)["model_output"]["routed_experts"])

    def probe_full(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        full = {n: _full(t).detach() for n, t in tensors.items()}  # collective: every rank
        return probe.take(full) if rank == 0 else None

    recorder = RouterRecorder(model)
    loss_fn = partial(ppo_loss, config=actor_config(train))

    def train_step(k: int, batch: dict[str, torch.Tensor]) -> dict:
        n = batch["input_ids"].shape[0]
        td = rank_batch(batch, k, rank, world, train.temperature)
        tu.assign_non_tensor(
            td,
            use_dynamic_bsz=False,
            micro_batch_size_per_gpu=n // world,
            calculate_entropy=True,
            return_model_output=True,
        )
        if own_routes:
            td["routed_experts"] = own_routes[k]
        with engine.train_mode():
            engine.optimizer_zero_grad()
            out = engine.forward_backward_batch(td, loss_fn, forward_only=False)
            grads = probe_full(
                {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in params.items()}
            )
            lr = engine.optimizer.param_groups[0]["lr"]
            grad_norm = engine.optimizer_step()
            engine.lr_scheduler_step()
        loss, log_probs, entropy, topk = gather_step_outputs(
            sum(out["loss"]),  # over micro-batches
            response_values(out["model_output"]["log_probs"], td),
            response_values(out["model_output"]["entropy"], td),
            recorder.take(),
            world,
            device.current_device(),
        )
        return dict(log_probs=log_probs, entropy=entropy, loss=loss, grad_norm=grad_norm, grads=grads, topk=topk, lr=lr)

    trace = record_steps(
        spec.label, spec.settings(world), stream, lambda: probe_full(params), train_step, progress, rank
    )
    dist.destroy_process_group()
    return trace
