"""Comparison against a reference, shared by tests and benchmarks: relative RMS error."""

from __future__ import annotations

import torch


def rel_rms(ref: torch.Tensor, out: torch.Tensor) -> float:
    """RMS(out - ref) / RMS(ref), computed in fp64."""
    diff = (out.double() - ref.double()).pow(2).mean().sqrt()
    return (diff / ref.double().pow(2).mean().sqrt().clamp_min(1e-30)).item()


def assert_rel_rms(name: str, ref: torch.Tensor, out: torch.Tensor, tol: float) -> None:
    """Fail when `out` has NaN/Inf, a different shape, or rel_rms(ref, out) > tol."""
    if out.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    if not torch.isfinite(out).all():
        raise AssertionError(f"{name}: output has {(~torch.isfinite(out)).sum().item()} non-finite values")
    err = rel_rms(ref, out)
    max_abs = (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0
    if not err <= tol:
        raise AssertionError(f"{name}: rel_rms {err:.3e} > {tol:.1e} (max |diff| {max_abs:.3e})")
