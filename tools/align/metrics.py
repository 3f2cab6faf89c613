"""Pairwise alignment metrics between two backends' traces (`trace.py`), one step or K steps.

Every metric compares backend `b` against backend `a`, the golden (the fp64 reference when it
runs). All arithmetic is fp64.

Metric names, their direction (a tolerance is an upper bound, or a lower bound for "min") and
meaning are in `METRICS`; `first_exceeded` names the first step where each leaves its tolerance.
"""

from __future__ import annotations

import math

import torch

from .trace import BackendTrace, StepTrace

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
