"""Shared test setup: GPU tests skip without an accelerator; test modules that need verl skip with the
reason where it is not installed or does not import (verl without Ray); GPU tests that share one device
between pytest-xdist workers take its memory in turns; fixed seeds; NaN-poisoned `torch.empty` in op tests
so tiles a kernel forgets to write show up as NaN."""

from __future__ import annotations

import fcntl
import functools
import gc
import importlib
import importlib.util
import os
import re
import tempfile
import warnings

import pytest
import torch
from verl_moe.ops import device

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# verl picks its platform once per process, at the first use; any test module that imports verl
# may trigger that during collection, so the choice must be made here, before all of them.
if not device.is_accelerator():
    os.environ.setdefault("VERL_PLATFORM", "cpu")
    # Triton kernels run in the interpreter on CPU. `triton.jit` reads this when a kernel module is
    # first imported, and any test module may import one during collection: decide it here.
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Top-level imports that need verl (and its Ray / TransferQueue / Hydra stack): verl, our engines and tools. A
# GPU machine with only torch, Triton and transformers still runs every ops / models test.
_NEEDS_VERL = re.compile(r"^(?:from|import)\s+(?:verl|verl_moe\.engines|verl_moe\.tools|hydra|omegaconf)\b", re.M)
_VERL_MISSING = importlib.util.find_spec("verl") is None


@functools.cache
def _verl_unmet() -> str | None:
    """Why verl cannot serve a test here (not installed, or does not import: verl imports Ray at top level,
    its worker groups `ray.experimental`), or None."""
    if _VERL_MISSING:
        return "needs verl and its dependencies (pip install verl-moe installs them)"
    try:
        importlib.import_module("verl")
        importlib.import_module("ray.experimental")
    except Exception as exc:
        return f"verl does not import here (pip install 'verl[verl-core]' brings Ray): {type(exc).__name__}: {exc}"
    return None


@pytest.fixture(scope="session")
def needs_verl():
    """For a test (or fixture) that runs verl, our engines or the align tool's engine backends inside its body:
    skipped with the reason where verl cannot serve it (modules that import verl at top level are handled at
    collection, below)."""
    reason = _verl_unmet()
    if reason is not None:
        pytest.skip(reason)


class _NeedsVerl(pytest.Module):
    """A test module that imports verl, on a machine without it: reported skipped with the reason."""

    def collect(self):
        pytest.skip(_verl_unmet())


# Optional packages a test module may reach at import (through our engines): missing, the module is skipped
_OPTIONAL = {"veomni": "VeOmni is not installed (pip install veomni==0.1.12 --no-deps)"}


class _ImportsVerl(pytest.Module):
    """A test module that imports verl, where verl is installed: an import error that verl's own import
    explains (no Ray, an incomplete one), or a missing optional package (`_OPTIONAL`), reports the module
    skipped with that reason; any other stays an error."""

    def _getobj(self):
        try:
            return super()._getobj()
        # an ImportError comes as pytest's CollectError (the ImportError its cause), an incomplete Ray's
        # AttributeError as is
        except Exception as exc:
            cause = exc.__cause__ if isinstance(exc.__cause__, ModuleNotFoundError) else exc
            missing = (getattr(cause, "name", None) or "").split(".")[0]
            reason = _verl_unmet() or _OPTIONAL.get(missing)
            if reason is None:
                raise
            pytest.skip(reason)


def pytest_pycollect_makemodule(module_path, parent):
    if module_path.name.startswith("test_") and _NEEDS_VERL.search(module_path.read_text()):
        return (_NeedsVerl if _VERL_MISSING else _ImportsVerl).from_parent(parent, path=module_path)
    return None


def pytest_collection_modifyitems(config, items):
    if device.is_accelerator():
        return
    skip = pytest.mark.skip(reason="needs a cuda/npu device; the same property is tested at small size on CPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# A GPU test that leaves more than this reserved on the device without the gpu_memory mark is reported (with
# 8 workers on an 80 GiB card, each has about this much when none is marked).
_SHARED_GPU_GIB = 8.0


@pytest.fixture(autouse=True)
def _device_memory_in_turns(request):
    """Under pytest-xdist, the workers' GPU tests share one device: a `gpu_memory` test runs alone on it (an
    exclusive lock), the others together (a shared lock), and each gives its cached blocks back afterwards, so
    a large test finds the memory that other workers' caches would otherwise hold."""
    worker_run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if worker_run is None or "gpu" not in request.keywords or not device.is_accelerator():
        yield
        return
    alone = request.node.get_closest_marker("gpu_memory") is not None
    module = device.device_module()
    with open(os.path.join(tempfile.gettempdir(), f"verl_moe_gpu_{worker_run}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        module.reset_peak_memory_stats()
        try:
            yield
        finally:
            peak = module.max_memory_reserved() / 2**30
            gc.collect()
            module.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)
    if not alone and peak > _SHARED_GPU_GIB:
        warnings.warn(
            f"{request.node.nodeid} reserved {peak:.1f} GiB of device memory: mark it gpu_memory", stacklevel=1
        )


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def nan_poison(monkeypatch):
    """Make float `torch.empty`/`torch.empty_like` return NaN-filled tensors for this test."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))
    yield
