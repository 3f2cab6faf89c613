"""What a backend records per optimizer step, and the one loop that records it.

A *trace* (`BackendTrace`) is one backend's run: per step (`StepTrace`) the response-token
log-probs and entropies, the loss, the pre-clip grad norm, a probe (`Probe`) of the gradient and
of the parameters after the update (per parameter group), and each MoE layer's top-k expert ids.
Every backend runs `record_steps`; what differs between backends is its `train_step`.
"""

from __future__ import annotations

import math
import re
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# Parameter groups, by the first pattern that matches the HF parameter name.
PARAM_GROUPS: tuple[tuple[str, str], ...] = (
    ("vision", r"^model\.visual\."),  # a vision-language model's tower (first: its blocks have attn / mlp too)
    ("router", r"\.mlp\.gate\.weight$"),
    ("experts", r"\.mlp\.(experts|shared_expert|shared_expert_gate)\."),
    ("gdn", r"\.linear_attn\."),
    ("attention", r"\.self_attn\."),
    ("embeddings", r"(embed_tokens|lm_head)\."),
)
OTHER_GROUP = "other"  # norms, dense MLPs


def param_group(name: str) -> str:
    """The group of an HF parameter name: vision, router, experts, gdn, attention, embeddings or other."""
    for group, pattern in PARAM_GROUPS:
        if re.search(pattern, name):
            return group
    return OTHER_GROUP


@dataclass(frozen=True)
class Probe:
    """Which coordinates of each parameter are recorded: all of them when the model holds at
    most `budget` elements, else a deterministic stride (offset from the name's CRC32), so every
    backend records the same coordinates without sharing state."""

    numels: dict[str, int]
    budget: int = 4_000_000

    @property
    def stride(self) -> int:
        total = sum(self.numels.values())
        return max(1, math.ceil(total / self.budget))

    def index(self, name: str) -> slice:
        s = self.stride
        return slice(zlib.crc32(name.encode()) % s if s > 1 else 0, None, s)

    def take(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per group, the probed coordinates of the named full tensors, concatenated in name order (fp64)."""
        out: dict[str, list[torch.Tensor]] = {}
        for name in sorted(named):
            t = named[name].detach().reshape(-1)[self.index(name)]
            out.setdefault(param_group(name), []).append(t.to("cpu", torch.float64))
        return {g: torch.cat(ts) for g, ts in out.items()}


@dataclass
class StepTrace:
    """What one backend recorded at one optimizer step (all tensors on CPU).

    log_probs, entropy: [NR] fp64, response tokens in batch order. loss, grad_norm: floats.
    grads, params: group -> probe vector (gradient before clipping; parameters after the update).
    topk: per MoE layer [NT, TOPK] int64 expert ids of every token, sorted along TOPK.
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor
    loss: float
    grad_norm: float
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    topk: list[torch.Tensor]
    lr: float = float("nan")


@dataclass
class BackendTrace:
    """One backend's run: its label, settings, initial parameter probe and per-step records."""

    label: str
    settings: dict
    params0: dict[str, torch.Tensor] = field(default_factory=dict)
    steps: list[StepTrace] = field(default_factory=list)
    wall_s: float = float("nan")


def load_trace(path) -> BackendTrace:
    """A worker's saved trace, loaded without running code: weights_only, with the trace's two
    dataclasses allowed. The allowlist is added at every call: torch's `safe_globals` context removes its
    classes on exit, whoever had added them (a per-call context also raced across `--jobs` threads)."""
    torch.serialization.add_safe_globals([BackendTrace, StepTrace])
    return torch.load(path, weights_only=True)


def record_steps(
    label: str,
    settings: dict,
    stream: list[dict[str, torch.Tensor]],
    probe_params: Callable[[], dict[str, torch.Tensor] | None],
    train_step: Callable[[int, dict[str, torch.Tensor]], dict],
    progress: Callable[[int], None] | None = None,
    rank: int = 0,
) -> BackendTrace | None:
    """The per-step record loop of every backend: the parameter probe at θ0, then per batch of
    `stream` one optimizer step and the parameter probe after it.

    probe_params(): the probed parameters now (a collective where parameters are sharded; None
        off rank 0). train_step(k, batch): one optimizer step on batch k, every rank; returns the
        `StepTrace` fields but `params` (log_probs, entropy, topk gathered over the ranks; loss,
        grad_norm, lr floats; grads the gradient probe before clipping). progress(k): k steps done.
    Returns the trace on rank 0, None on the other ranks."""
    trace = BackendTrace(label=label, settings=settings, params0=probe_params())
    start = time.perf_counter()
    for k, batch in enumerate(stream):
        out = train_step(k, batch)
        params = probe_params()
        if rank == 0:
            trace.steps.append(StepTrace(params=params, **out))
            if progress:
                progress(k + 1)
    trace.wall_s = time.perf_counter() - start
    return trace if rank == 0 else None


def response_values(per_token: torch.Tensor, td) -> torch.Tensor:
    """Per-token values over the packed sequences (nested or [T]) -> [NR] over response tokens, batch order."""
    from verl.workers.utils.padding import no_padding_2_padding

    padded = no_padding_2_padding(per_token, td)
    mask = td["response_mask"]
    mask = (mask.to_padded_tensor(0) if mask.is_nested else mask).bool()
    return padded[mask].detach().to("cpu", torch.float64)


def gather_cat(tensors: list[torch.Tensor] | torch.Tensor, world: int):
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
    return total.item() / world, gather_cat(log_probs, world), gather_cat(entropy, world), gather_cat(topk, world)
