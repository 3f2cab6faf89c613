"""Pairwise alignment metrics between two backends' traces, one step or K steps.

A *trace* is what a backend records per optimizer step (see `StepTrace`): response-token
log-probs and entropies, the loss, the pre-clip grad norm, a probe of the gradient and of the
parameters after the update (per parameter group), and each MoE layer's top-k expert ids.
Every metric compares backend `b` against backend `a`, the golden (the fp64 reference when it
runs). All arithmetic is fp64.

Metric names, their direction (a tolerance is an upper bound, or a lower bound for "min") and
meaning are in `METRICS`; `first_exceeded` names the first step where each leaves its tolerance.
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass, field

import torch

# name -> ("max" | "min", meaning). A tolerance bounds the value from above ("max") or below ("min").
METRICS: dict[str, tuple[str, str]] = {
    "logp_abs_diff_mean": ("max", "mean |Δ log-prob| over response tokens"),
    "logp_abs_diff_max": ("max", "max |Δ log-prob| over response tokens"),
    "kl_k3_mean": ("max", "mean k3 KL estimate exp(r)-1-r, r = logp_a - logp_b, over response tokens"),
    "entropy_abs_diff_mean": ("max", "mean |Δ entropy| over response tokens"),
    "loss_abs_diff": ("max", "|Δ loss| (verl policy loss)"),
    "grad_norm_rel_diff": ("max", "|gn_b - gn_a| / gn_a, pre-clip total grad norm"),
    "grad_cosine_min": ("min", "smallest per-group cosine of the flattened gradients"),
    "router_flip_rate": ("max", "share of (token, MoE layer) whose top-k expert set differs"),
    "param_drift": ("max", "||θ_b - θ_a|| / ||θ_a - θ_0|| after the step (parameter probe)"),
}

# Parameter groups, by the first pattern that matches the HF parameter name.
PARAM_GROUPS: tuple[tuple[str, str], ...] = (
    ("router", r"\.mlp\.gate\.weight$"),
    ("experts", r"\.mlp\.(experts|shared_expert|shared_expert_gate)\."),
    ("gdn", r"\.linear_attn\."),
    ("attention", r"\.self_attn\."),
    ("embeddings", r"(embed_tokens|lm_head)\."),
)
OTHER_GROUP = "other"  # norms, dense MLPs


def param_group(name: str) -> str:
    """The group of an HF parameter name: router, experts, gdn, attention, embeddings or other."""
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


def k3(logp_a: torch.Tensor, logp_b: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(b || a) on tokens sampled from b: exp(r) - 1 - r, r = logp_a - logp_b."""
    r = logp_a.double() - logp_b.double()
    return torch.expm1(r) - r


def token_metrics(a: StepTrace, b: StepTrace) -> dict[str, float]:
    if a.log_probs.shape != b.log_probs.shape:
        raise ValueError(f"response tokens differ: {tuple(a.log_probs.shape)} vs {tuple(b.log_probs.shape)}")
    d = (a.log_probs.double() - b.log_probs.double()).abs()
    return {
        "logp_abs_diff_mean": d.mean().item(),
        "logp_abs_diff_max": d.max().item(),
        "kl_k3_mean": k3(a.log_probs, b.log_probs).mean().item(),
        "entropy_abs_diff_mean": (a.entropy.double() - b.entropy.double()).abs().mean().item(),
    }


def cosine(x: torch.Tensor, y: torch.Tensor) -> float:
    """Cosine of two flat vectors in fp64; 1.0 when both are zero, nan when only one is."""
    x, y = x.double(), y.double()
    nx, ny = x.norm(), y.norm()
    if nx == 0 and ny == 0:
        return 1.0
    if nx == 0 or ny == 0:
        return float("nan")
    return (x @ y / (nx * ny)).item()


def router_flip_rate(topk_a: list[torch.Tensor], topk_b: list[torch.Tensor]) -> float | None:
    """Share of (token, MoE layer) pairs whose top-k expert *set* differs (order inside the set
    ignored); None when neither backend recorded routing."""
    if not topk_a and not topk_b:
        return None
    if len(topk_a) != len(topk_b):
        raise ValueError(f"MoE layer counts differ: {len(topk_a)} vs {len(topk_b)}")
    flips, total = 0, 0
    for ia, ib in zip(topk_a, topk_b):
        if ia.shape != ib.shape:
            raise ValueError(f"top-k shapes differ: {tuple(ia.shape)} vs {tuple(ib.shape)}")
        sa, sb = ia.sort(dim=-1).values, ib.sort(dim=-1).values
        flips += (sa != sb).any(dim=-1).sum().item()
        total += sa.shape[0]
    return flips / total


def _norm(vectors: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(v.double().pow(2).sum().item() for v in vectors.values()))


def param_drift(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], a0: dict[str, torch.Tensor]) -> float:
    """||θ_b - θ_a|| / ||θ_a - θ_0|| over the parameter probe: 0 when identical, 1 when the two
    backends disagree by as much as backend a has moved."""
    diff = _norm({g: b[g].double() - a[g].double() for g in a})
    moved = _norm({g: a[g].double() - a0[g].double() for g in a})
    if moved == 0:
        return 0.0 if diff == 0 else float("inf")
    return diff / moved


def step_metrics(a: StepTrace, b: StepTrace, a0: dict[str, torch.Tensor]) -> dict:
    """All pairwise metrics of one step; `grad_cosine` holds the per-group cosines."""
    out = token_metrics(a, b)
    out["loss_abs_diff"] = abs(a.loss - b.loss)
    out["grad_norm_rel_diff"] = abs(b.grad_norm - a.grad_norm) / a.grad_norm if a.grad_norm else None
    groups = sorted(set(a.grads) & set(b.grads))
    out["grad_cosine"] = {g: cosine(a.grads[g], b.grads[g]) for g in groups}
    out["grad_cosine_min"] = min(out["grad_cosine"].values(), key=lambda c: (c == c, c)) if groups else None
    out["router_flip_rate"] = router_flip_rate(a.topk, b.topk)
    out["param_drift"] = param_drift(a.params, b.params, a0)
    return out


def exceeds(metric: str, value: float | None, tol: float) -> bool:
    """True when `value` is outside `tol` for `metric`. NaN counts as outside; None (not
    measured, e.g. no routing recorded) does not."""
    if value is None:
        return False
    if value != value:
        return True
    direction = METRICS[metric][0]
    return value > tol if direction == "max" else value < tol


def first_exceeded(curves: list[dict], tolerances: dict[str, float]) -> dict[str, int | None]:
    """Per metric with a tolerance, the first step index whose value leaves it (None: never)."""
    first: dict[str, int | None] = {}
    for metric, tol in tolerances.items():
        first[metric] = next(
            (k for k, row in enumerate(curves) if metric in row and exceeds(metric, row[metric], tol)), None
        )
    return first


def compare(a: BackendTrace, b: BackendTrace, tolerances: dict[str, float]) -> dict:
    """Pair report: one-step metrics (step 0), per-step curves, first step out of tolerance."""
    n = min(len(a.steps), len(b.steps))
    if n == 0:
        raise ValueError(f"no common steps between {a.label} and {b.label}")
    curves = [step_metrics(a.steps[k], b.steps[k], a.params0) for k in range(n)]
    first = first_exceeded(curves, tolerances)
    hits = [k for k in first.values() if k is not None]
    return {
        "a": a.label,
        "b": b.label,
        "one_step": curves[0],
        "curves": curves,
        "tolerances": dict(tolerances),
        "first_exceeded": first,
        "first_divergence_step": min(hits) if hits else None,
        "exceeded_at_step0": sorted(m for m, k in first.items() if k == 0),
    }
