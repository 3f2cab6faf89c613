"""Exact mode's shared piece: an op whose forward is its exact form and whose gradient is its fast form's.

An exact form computes each token's row by one fixed sequence of floating-point operations, whatever
else shares the call (how many rows, which sequences, their packing): that is what lets the rollout's
decode step and the trainer's packed forward give bitwise-equal log-probs. Only the forward needs
that. The backward recomputes the fast form at the same inputs and returns its gradient, which
differs from the exact forward's own derivative by rounding only (docs/exact.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from . import device
from .dispatch import resolve

_TENSOR = object()  # marks a value slot held in the saved tensors


class ExactForwardFunction(torch.autograd.Function):
    """forward(exact, fast, names, *values): `exact(*args, **kwargs)` where the last len(names) values
    are the keyword arguments `names`; backward: the gradient of `fast` called the same way."""

    @staticmethod
    def forward(ctx, exact, fast, names, *values):
        ctx.fast, ctx.names = fast, names
        ctx.save_for_backward(*(v for v in values if isinstance(v, torch.Tensor)))
        ctx.others = [_TENSOR if isinstance(v, torch.Tensor) else v for v in values]
        args, kwargs = _split(values, names)
        return exact(*args, **kwargs)

    @staticmethod
    def backward(ctx, *grads):
        saved = iter(ctx.saved_tensors)
        needs = ctx.needs_input_grad[3:]
        values = []
        for other, need in zip(ctx.others, needs):
            if other is _TENSOR:
                t = next(saved).detach()
                values.append(t.requires_grad_() if need else t)
            else:
                values.append(other)
        args, kwargs = _split(values, ctx.names)
        with torch.enable_grad():
            out = ctx.fast(*args, **kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [
            (o, g) for o, g in zip(outs, grads) if g is not None and isinstance(o, torch.Tensor) and o.requires_grad
        ]
        wrt = [v for v, need in zip(values, needs) if need]
        got = iter(
            torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
            if pairs and wrt
            else [None] * len(wrt)
        )
        return (None, None, None, *(next(got) if need else None for need in needs))


def _split(values, names):
    n = len(values) - len(names)
    return values[:n], dict(zip(names, values[n:]))


def by_device(cpu: Callable, accelerator: Callable) -> Callable:
    """One op from two forms of it: `cpu` for tensors on the cpu (torch code, exact there with torch's scalar
    kernels), `accelerator` on cuda / npu (Triton kernels with fixed tiles). The first tensor argument decides."""

    def op(*args, **kwargs):
        first = next(v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))
        return (cpu if first.device.type == "cpu" else accelerator)(*args, **kwargs)

    op.__doc__ = cpu.__doc__
    return op


def device_default(op: str) -> Callable:
    """`op`'s default implementation, resolved at each call (`dispatch.resolve(op)`): the fast form of an
    exact op on devices, whose gradient exact mode takes there."""

    def fast(*args, **kwargs):
        return resolve(op)(*args, **kwargs)

    return fast


def exact_forward(exact: Callable, fast: Callable) -> Callable:
    """The op `exact` (same arguments and returns as `fast`) made differentiable through `fast`'s gradient.
    Without a gradient to track it is `exact` itself."""

    @functools.wraps(exact)
    def op(*args, **kwargs):
        values = (*args, *kwargs.values())
        if not torch.is_grad_enabled() or not any(isinstance(v, torch.Tensor) and v.requires_grad for v in values):
            return exact(*args, **kwargs)
        return ExactForwardFunction.apply(exact, fast, tuple(kwargs), *values)

    return op


_TILES_AGREE: dict[tuple, bool] = {}


def tiles_agree(key: tuple, outputs: Callable[[], list[torch.Tensor]]) -> bool:
    """Whether a kernel's candidate tile configs give bitwise-equal results on this device: `outputs()` runs the
    kernel once per config on the same probe inputs. On tensor cores a tile config decides which rows and columns
    a program owns, not the order in which a row's products over K are added (ascending, in 16-wide steps
    into one fp32 accumulator), so they agree and exact mode may pick tiles by the row count. Measured once per
    `key` (kernel, dtype, device) and remembered; where they differ (another device or compiler) the callers
    keep their one pinned config. False, not remembered, while a device graph is being captured (nothing may
    synchronise then): the pinned config gives the same bits either way."""
    if key not in _TILES_AGREE:
        if device.capturing():
            return False
        outs = outputs()
        _TILES_AGREE[key] = all(torch.equal(out, outs[0]) for out in outs[1:])
    return _TILES_AGREE[key]


__all__ = ["ExactForwardFunction", "by_device", "device_default", "exact_forward", "tiles_agree"]
