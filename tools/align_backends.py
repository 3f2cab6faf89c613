"""The backends `verl-moe align` runs: one function per backend, each returning a `BackendTrace`.

- `reference`: the model spec in fp64, eager, single process; log-probs and entropy from full
  fp64 logits (not the fused op), verl's `ppo_loss`, torch AdamW with verl's LR schedule.
- `fsdp2`: our `MoeFsdp2Engine` through verl's engine contract on `world` ranks (gloo on CPU),
  launched with torchrun; this module's `__main__` is the per-rank worker.
- `veomni`: our `MoeVeOmniEngine` (VeOmni's parallel state), launched like fsdp2; option
  `ep=N` splits the routed experts over N ranks (expert parallelism).
- `megatron`: megatron-core's `GPTModel` on its local layer specs from the converted HF weights
  (`tools/align_megatron.py`, GPU only); reported as skipped with the reason where it cannot run.

A backend is named `name[:key=value[:key=value...]]`; keys: `dtype` (fp64|fp32|bf16),
`router` (bf16|fp32|fp64: the router's compute dtype), `world` (ranks), `ep` (veomni: expert-
parallel size), and
`cfg.<field>[.<subfield>]=<json>` to perturb the HF config the backend builds from (e.g.
`reference:cfg.rope_parameters.partial_rotary_factor=0.5`, a wrong rotary dim).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .align_metrics import BackendTrace, Probe, StepTrace

BACKENDS = ("reference", "fsdp2", "veomni", "megatron")
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}
# compute dtype when the backend name gives none: engines train in bf16 on an accelerator, fp32 on CPU
DEFAULT_DTYPE = {"reference": "fp64", "fsdp2": ("bf16", "fp32"), "veomni": ("bf16", "fp32"), "megatron": "bf16"}
LOSS_MODES = {  # --loss -> verl ActorConfig fields (GSPO: the paper's clip range and aggregation)
    "grpo": dict(policy_loss={"loss_mode": "vanilla"}, loss_agg_mode="token-mean", clip_ratio=0.2),
    "gspo": dict(
        policy_loss={"loss_mode": "gspo"},
        loss_agg_mode="seq-mean-token-mean",
        clip_ratio_low=3e-4,
        clip_ratio_high=4e-4,
    ),
}


@dataclass(frozen=True)
class BackendSpec:
    """A parsed backend name. dtype / router / world / ep are None where the backend's default applies."""

    name: str
    dtype: str | None = None
    router: str | None = None
    world: int | None = None
    ep: int | None = None  # expert-parallel size (veomni)
    overrides: tuple[tuple[str, str], ...] = ()

    @property
    def label(self) -> str:
        parts = [self.name]
        options = (("dtype", self.dtype), ("router", self.router), ("world", self.world), ("ep", self.ep))
        parts += [f"{k}={v}" for k, v in options if v]
        parts += [f"cfg.{k}={v}" for k, v in self.overrides]
        return ":".join(parts)

    @property
    def compute_dtype(self) -> str:
        from verl_moe.ops import device

        default = DEFAULT_DTYPE[self.name]
        if isinstance(default, tuple):
            default = default[0] if device.is_accelerator() else default[1]
        return self.dtype or default

    @property
    def router_dtype(self) -> str:
        """The router dtype this backend runs with (fp32, or fp64 in an fp64 model, by default)."""
        return self.router or ("fp64" if self.compute_dtype == "fp64" else "fp32")

    def ops_config(self):
        """OpsConfig for the model spec, carrying this backend's router dtype."""
        from verl_moe.models import OpsConfig

        try:
            return OpsConfig(router_dtype=self.router_dtype)
        except ValueError as e:
            raise ValueError(
                f"backend {self.label}: router dtype {self.router_dtype} is not offered by OpsConfig ({e})"
            ) from e


def parse_backend(text: str) -> BackendSpec:
    """`name[:key=value...]` -> BackendSpec; ValueError on an unknown name, key or value."""
    name, *options = text.strip().split(":")
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r} in {text!r}; choices: {list(BACKENDS)}")
    kw: dict = {}
    overrides = []
    for opt in options:
        key, sep, value = opt.partition("=")
        if not sep:
            raise ValueError(f"backend option {opt!r} in {text!r} must be key=value")
        if key in ("dtype", "router"):
            if value not in DTYPES:
                raise ValueError(f"{key}={value!r} in {text!r}: choose from {list(DTYPES)}")
            kw[key] = value
        elif key in ("world", "ep"):
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"{key}={value!r} in {text!r} must be a positive integer")
            if key == "ep" and name != "veomni":
                raise ValueError(f"ep= in {text!r}: expert parallelism is a veomni engine option")
            kw[key] = int(value)
        elif key.startswith("cfg."):
            json.loads(value)  # must be a JSON literal
            overrides.append((key[4:], value))
        else:
            raise ValueError(f"unknown backend option {key!r} in {text!r}; keys: dtype, router, world, ep, cfg.<field>")
    return BackendSpec(name=name, overrides=tuple(overrides), **kw)


@dataclass(frozen=True)
class TrainSettings:
    """What every backend must do identically: the loss, optimizer and schedule."""

    loss: str = "grpo"
    lr: float = 1e-4
    warmup_steps: int = 0
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    clip_grad: float = 1.0
    temperature: float = 1.0
    probe_budget: int = 4_000_000


@dataclass(frozen=True)
class Job:
    """Everything one backend run needs; JSON-serialisable so the distributed worker can read it."""

    backend: str  # the backend text, parsed again by the worker
    model_dir: str
    stream_path: str  # torch.save'd list of padded verl batches (with old_log_probs)
    trace_path: str
    train: TrainSettings = field(default_factory=TrainSettings)
    world_size: int = 1

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> Job:
        d = json.loads(Path(path).read_text())
        d["train"] = TrainSettings(**{**d["train"], "betas": tuple(d["train"]["betas"])})
        return cls(**d)


def model_dir_for(spec: BackendSpec, model_dir: str | Path, scratch: Path) -> Path:
    """`model_dir`, or a copy of it whose config.json carries the spec's `cfg.` overrides
    (weights linked, not copied)."""
    if not spec.overrides:
        return Path(model_dir)
    src, dst = Path(model_dir), scratch / spec.label.replace(":", "_").replace("=", "-").replace("/", "_")
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    config = json.loads((src / "config.json").read_text())
    for path, value in spec.overrides:
        *parents, leaf = path.split(".")
        node = config
        for p in parents:
            if not isinstance(node.get(p), dict):
                raise ValueError(f"cfg.{path}: {p!r} is not a dict in {src / 'config.json'}")
            node = node[p]
        if leaf not in node:
            raise ValueError(f"cfg.{path}: no field {leaf!r} in {src / 'config.json'}")
        node[leaf] = json.loads(value)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f.resolve())
    return dst


# ---- verl batch helpers ------------------------------------------------------------------------


def actor_config(train: TrainSettings):
    """verl's ActorConfig for `train.loss` (entropy coefficient 0, no KL loss)."""
    from verl.workers.config import ActorConfig

    return ActorConfig(
        strategy="fsdp2",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=-1,
        entropy_coeff=0.0,
        use_kl_loss=False,
        **LOSS_MODES[train.loss],
    )


def to_verl(batch: dict[str, torch.Tensor], temperature: float, global_batch_size: int):
    """A padded rollout batch -> verl's no-padding TensorDict (nested input_ids / position_ids / loss_mask)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    td = tu.get_tensordict(
        dict(batch), non_tensor_dict={"temperature": temperature, "global_batch_size": global_batch_size}
    )
    return left_right_2_no_padding(td)


def rank_batch(batch: dict[str, torch.Tensor], step: int, rank: int, world: int, temperature: float):
    """This rank's contiguous block of a padded batch's rows (as verl dispatches), in verl's
    no-padding layout; ValueError when the rows do not split evenly over the ranks."""
    n = batch["input_ids"].shape[0]
    if n % world:
        raise ValueError(f"step {step}: {n} sequences do not split over {world} ranks")
    rows = slice(rank * n // world, (rank + 1) * n // world)
    return to_verl({key: v[rows] for key, v in batch.items()}, temperature, global_batch_size=n)


def response_values(per_token: torch.Tensor, td) -> torch.Tensor:
    """Per-token values over the packed sequences (nested or [T]) -> [NR] over response tokens, batch order."""
    from verl.workers.utils.padding import no_padding_2_padding

    padded = no_padding_2_padding(per_token, td)
    mask = td["response_mask"]
    mask = (mask.to_padded_tensor(0) if mask.is_nested else mask).bool()
    return padded[mask].detach().to("cpu", torch.float64)


def lr_schedule(train: TrainSettings, optimizer):
    from verl.utils.torch_functional import get_constant_schedule_with_warmup

    return get_constant_schedule_with_warmup(optimizer, num_warmup_steps=train.warmup_steps)


def topk_sets(router_logits: tuple[torch.Tensor, ...], top_k: int) -> list[torch.Tensor]:
    return [logits.detach().topk(top_k, dim=-1).indices.sort(dim=-1).values.cpu() for logits in router_logits]


# ---- reference ---------------------------------------------------------------------------------


def eager_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float):
    """Full-logit log-prob and entropy per token ([T] each), in the weight's dtype (fp32 at least)."""
    dtype = torch.promote_types(weight.dtype, torch.float32)
    logits = (hidden.to(dtype) @ weight.to(dtype).T) / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, labels[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def run_reference(job: Job, progress: Callable[[int], None] | None = None) -> BackendTrace:
    """The model spec eager in one process (fp64 unless the spec says otherwise)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss
    from verl_moe.ops import device

    from verl_moe import models

    spec = parse_backend(job.backend)
    dtype = DTYPES[spec.compute_dtype]
    dev = device.current_device()
    torch.manual_seed(0)
    model = models.from_pretrained(job.model_dir, dtype=dtype, device=dev, ops=spec.ops_config())
    model.train()
    stream = torch.load(job.stream_path, weights_only=True)  # a list of dicts of tensors
    cfg = actor_config(job.train)
    params = dict(model.named_parameters())
    probe = Probe({n: p.numel() for n, p in params.items()}, budget=job.train.probe_budget)
    optimizer = torch.optim.AdamW(
        list(params.values()), lr=job.train.lr, betas=job.train.betas, eps=1e-8, weight_decay=job.train.weight_decay
    )
    scheduler = lr_schedule(job.train, optimizer)
    trace = BackendTrace(label=spec.label, settings=_settings(spec, 1), params0=probe.take(params))
    top_k = model.arch.num_experts_per_tok
    start = time.perf_counter()
    for k, batch in enumerate(stream):
        td = to_verl(batch, job.train.temperature, global_batch_size=batch["input_ids"].shape[0]).to(dev)
        ids = td["input_ids"]
        offsets = ids.offsets()
        tokens = ids.values()  # [T] packed; the model takes [1, T] plus cu_seqlens
        positions = td["position_ids"].values()
        optimizer.zero_grad(set_to_none=True)
        out = model(tokens[None], positions[None], offsets.to(torch.int32), output_router_logits=True)
        labels = torch.roll(tokens, shifts=-1)
        logp, entropy = eager_logprobs(out.last_hidden_state[0], model.lm_head.weight, labels, job.train.temperature)
        model_output = {
            "log_probs": torch.nested.nested_tensor_from_jagged(logp, offsets),
            "entropy": torch.nested.nested_tensor_from_jagged(entropy, offsets),
        }
        tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=int(td["loss_mask"].sum().item()))
        loss, _ = ppo_loss(cfg, model_output, td)
        loss.backward()
        grads = probe.take({n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in params.items()})
        grad_norm = torch.nn.utils.clip_grad_norm_(list(params.values()), job.train.clip_grad).item()
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        trace.steps.append(
            StepTrace(
                log_probs=response_values(logp, td),
                entropy=response_values(entropy, td),
                loss=loss.item(),
                grad_norm=grad_norm,
                grads=grads,
                params=probe.take(params),
                topk=topk_sets(out.router_logits, top_k),
                lr=lr,
            )
        )
        if progress:
            progress(k + 1)
    trace.wall_s = time.perf_counter() - start
    return trace


def _settings(spec: BackendSpec, world: int) -> dict:
    return {
        "name": spec.name,
        "dtype": spec.compute_dtype,
        "router_dtype": spec.router_dtype,
        "world_size": world,
        "overrides": [f"{k}={v}" for k, v in spec.overrides],
    }


def release_device_memory() -> None:
    """Return this process's cached accelerator memory (the fp64 model it built is garbage now)."""
    from verl_moe.ops import device

    gc.collect()
    device.empty_cache()


@torch.no_grad()
def fill_old_log_probs(model_dir: str | Path, stream: list[dict], temperature: float) -> None:
    """Set each batch's `old_log_probs` [B, R] (fp32, 0 on padding) from the fp64 reference at θ0,
    as verl recomputes them with the actor before an update."""
    from verl.workers.utils.padding import no_padding_2_padding
    from verl_moe.ops import device

    from verl_moe import models

    dev = device.current_device()
    model = models.from_pretrained(
        model_dir, dtype=torch.float64, device=dev, ops=BackendSpec("reference").ops_config()
    )
    for batch in stream:
        if "old_log_probs" in batch:
            continue
        td = to_verl(batch, temperature, global_batch_size=batch["input_ids"].shape[0]).to(dev)
        tokens, offsets = td["input_ids"].values(), td["input_ids"].offsets()
        out = model(tokens[None], td["position_ids"].values()[None], offsets.to(torch.int32))
        logp, _ = eager_logprobs(out.last_hidden_state[0], model.lm_head.weight, torch.roll(tokens, -1), temperature)
        padded = no_padding_2_padding(logp, td).cpu() * batch["response_mask"]
        batch["old_log_probs"] = padded.to(torch.float32)
    del model
    release_device_memory()


class RouterRecorder:
    """Forward hooks on every `TopKRouter` of a module: the top-k expert ids ([N, TOPK], sorted
    along TOPK) of each router's first call since the last `take()`, in layer order. Later calls
    (activation-checkpoint recomputation in backward) are ignored."""

    def __init__(self, module: torch.nn.Module):
        from verl_moe.models.layers import TopKRouter

        self.routers = [m for m in module.modules() if isinstance(m, TopKRouter)]
        self.first: dict[int, torch.Tensor] = {}
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]

    def _hook(self, module, args, output):
        _, _, topk_idx = output
        self.first.setdefault(id(module), topk_idx.detach().sort(dim=-1).values.cpu())

    def take(self) -> list[torch.Tensor]:
        out = [self.first[id(r)] for r in self.routers if id(r) in self.first]
        self.first = {}
        return out


# ---- skips -------------------------------------------------------------------------------------


def unavailable(spec: BackendSpec) -> str | None:
    """Why `spec` cannot run on this machine, or None when it can."""
    if spec.name == "veomni" and importlib.util.find_spec("veomni") is None:  # not imported here: it logs a banner
        return "VeOmni is not installed (pip install --no-deps 'verl-moe[veomni]'; see scripts/install.sh)"
    if spec.name == "megatron":
        from .align_megatron import megatron_unavailable

        return megatron_unavailable(spec)
    if spec.name == "fsdp2":
        try:
            from verl_moe.engines import fsdp2  # noqa: F401
        except ImportError as e:
            return f"verl_moe.engines.fsdp2 is not importable: {e}"
    return None


# ---- dispatch ----------------------------------------------------------------------------------


def run_backend(job: Job, log_dir: Path, progress: Callable[[int], None] | None = None) -> BackendTrace:
    """Run one backend, in this process (reference) or under torchrun (distributed engines);
    its trace is also saved at `job.trace_path`."""
    spec = parse_backend(job.backend)
    if spec.name == "reference":
        trace = run_reference(job, progress)
        torch.save(trace, job.trace_path)
        release_device_memory()  # the workers launched next need the accelerator memory it cached
        return trace
    return _launch(job, log_dir, progress)


def _launch(job: Job, log_dir: Path, progress: Callable[[int], None] | None) -> BackendTrace:
    """torchrun the worker below; stream its log, advance `progress` on its step lines."""
    log_dir.mkdir(parents=True, exist_ok=True)
    spec = parse_backend(job.backend)
    job_path = log_dir / f"{Path(job.trace_path).stem}.job.json"
    job.dump(job_path)
    log_path = log_dir / f"{Path(job.trace_path).stem}.log"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={job.world_size}",
        "-m",
        "verl_moe.tools.align_backends",
        str(job_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for line in proc.stdout:
            log.write(line)
            if line.startswith(STEP_MARK) and progress:
                progress(int(line[len(STEP_MARK) :].split()[0]))
        code = proc.wait()
    if code != 0:
        errors = [ln for ln in log_path.read_text().splitlines() if re.match(r"^[\w.]+(Error|Exception)\b", ln)]
        cause = errors[0] if errors else "see the log"
        raise RuntimeError(f"{spec.label}: worker exited with {code}: {cause} (log {log_path})")
    with torch.serialization.safe_globals([BackendTrace, StepTrace]):  # the trace's two dataclasses, no other code
        return torch.load(job.trace_path, weights_only=True)


STEP_MARK = "ALIGN_STEP "


def _worker_main(job_path: str) -> None:
    job = Job.load(job_path)
    spec = parse_backend(job.backend)
    start = time.perf_counter()

    def mark(k: int) -> None:  # the parent's progress bar reads k; the log keeps the seconds since start
        print(f"{STEP_MARK}{k} {time.perf_counter() - start:.1f}s", flush=True)

    if spec.name in ("fsdp2", "veomni"):
        trace = run_engine_rank(job, mark)
    elif spec.name == "megatron":
        from .align_megatron import run_megatron_rank

        trace = run_megatron_rank(job, mark)
    else:
        raise ValueError(f"backend {spec.name} has no distributed worker")
    if trace is not None:  # rank 0
        torch.save(trace, job.trace_path)


# ---- fsdp2 (one rank of a torchrun job) --------------------------------------------------------


def _gather_cat(tensors: list[torch.Tensor] | torch.Tensor, world: int):
    """all_gather_object of CPU tensors (a tensor or a list per MoE layer) concatenated in rank order."""
    import torch.distributed as dist

    parts: list = [None] * world
    dist.all_gather_object(parts, tensors)
    if isinstance(tensors, torch.Tensor):
        return torch.cat(parts)
    return [torch.cat([p[i] for p in parts]) for i in range(len(tensors))]


def gather_step_outputs(loss: float, log_probs, entropy, topk, world: int, dev) -> tuple:
    """The collectives every rank runs after a step: the loss as verl's TrainingWorker reports it
    (summed here, mean over ranks; reduced on `dev`, since NCCL reduces no CPU tensor) and the
    response log-probs, entropy and per-layer top-k of all ranks in rank order."""
    import torch.distributed as dist

    total = torch.tensor([loss], dtype=torch.float64, device=dev)
    dist.all_reduce(total)
    return total.item() / world, _gather_cat(log_probs, world), _gather_cat(entropy, world), _gather_cat(topk, world)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def build_engine(spec: BackendSpec, model_dir: str, train: TrainSettings, total_steps: int):
    """`MoeFsdp2Engine` or `MoeVeOmniEngine` for `spec`: fp32 master weights, the spec's compute
    and router dtypes, fp32 gradient reduction, AdamW and a constant LR after `train.warmup_steps`."""
    from verl.workers.config import FSDPOptimizerConfig, HFModelConfig, VeOmniOptimizerConfig

    model_config = HFModelConfig(path=model_dir, load_tokenizer=False)
    optimizer = dict(lr=train.lr, weight_decay=train.weight_decay, betas=train.betas, clip_grad=train.clip_grad)
    if spec.name == "veomni":
        from verl_moe.engines.config import MoeVeOmniEngineConfig
        from verl_moe.engines.veomni import MoeVeOmniEngine

        engine_config = MoeVeOmniEngineConfig(
            mixed_precision=True,
            param_dtype=spec.compute_dtype,
            expert_parallel_size=spec.ep or 1,
            ops=spec.ops_config(),
            use_dynamic_bsz=False,
        )
        optimizer_config = VeOmniOptimizerConfig(
            **optimizer,
            lr_warmup_steps_ratio=train.warmup_steps / max(total_steps, 1),
            total_training_steps=total_steps,
        )
        return MoeVeOmniEngine(model_config, engine_config, optimizer_config, checkpoint_config=None)
    from verl_moe.engines.config import MoeFsdp2EngineConfig
    from verl_moe.engines.fsdp2 import MoeFsdp2Engine

    engine_config = MoeFsdp2EngineConfig(
        strategy="fsdp2",
        model_dtype="fp32",
        mixed_precision={"param_dtype": spec.compute_dtype, "reduce_dtype": "fp32"},
        ops=spec.ops_config(),
        use_dynamic_bsz=False,
    )
    optimizer_config = FSDPOptimizerConfig(
        **optimizer, lr_warmup_steps=train.warmup_steps, total_training_steps=total_steps
    )
    return MoeFsdp2Engine(model_config, engine_config, optimizer_config, checkpoint_config=None)


def run_engine_rank(job: Job, progress: Callable[[int], None]) -> BackendTrace | None:
    """One rank of the fsdp2 / veomni backend: verl's engine contract on our engine, batch rows
    split in contiguous blocks over the ranks (as verl dispatches). Returns the trace on rank 0."""
    from functools import partial

    import torch.distributed as dist
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss
    from verl_moe.ops import device

    spec = parse_backend(job.backend)
    if spec.compute_dtype not in ("fp32", "bf16"):
        raise ValueError(f"{spec.label}: our engines compute in fp32 or bf16, not {spec.compute_dtype}")
    dist.init_process_group(backend=device.dist_backend())
    rank, world = dist.get_rank(), dist.get_world_size()
    device.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.manual_seed(0)
    stream = torch.load(job.stream_path, weights_only=True)  # a list of dicts of tensors
    train = job.train
    engine = build_engine(spec, job.model_dir, train, total_steps=len(stream))
    engine.initialize()
    model = engine.module.model
    params = dict(model.named_parameters())
    probe = Probe({n: p.numel() for n, p in params.items()}, budget=train.probe_budget)

    def probe_full(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        full = {n: _full(t).detach() for n, t in tensors.items()}  # collective: every rank
        return probe.take(full) if rank == 0 else None

    trace = BackendTrace(label=spec.label, settings=_settings(spec, world), params0=probe_full(params))
    recorder = RouterRecorder(model)
    loss_fn = partial(ppo_loss, config=actor_config(train))
    start = time.perf_counter()
    for k, batch in enumerate(stream):
        n = batch["input_ids"].shape[0]
        td = rank_batch(batch, k, rank, world, train.temperature)
        tu.assign_non_tensor(
            td,
            use_dynamic_bsz=False,
            micro_batch_size_per_gpu=n // world,
            calculate_entropy=True,
            return_model_output=True,
        )
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
        after = probe_full(params)
        if rank == 0:
            trace.steps.append(
                StepTrace(
                    log_probs=log_probs,
                    entropy=entropy,
                    loss=loss,
                    grad_norm=grad_norm,
                    grads=grads,
                    params=after,
                    topk=topk,
                    lr=lr,
                )
            )
            progress(k + 1)
    trace.wall_s = time.perf_counter() - start
    dist.destroy_process_group()
    return trace if rank == 0 else None


if __name__ == "__main__":  # torchrun ... -m verl_moe.tools.align_backends JOB.json
    _worker_main(sys.argv[1])
