"""Engine tests run verl on our cpu platform (gloo ranks, Ray CPU bundles), chosen before anything imports
verl. They need a complete Ray (verl's worker groups import `ray.experimental`) and our plugin's `cpu`
platform in verl's registry; where either is missing (e.g. a GPU machine with a partial install) the folder's
modules that use verl are skipped with the reason instead of failing at collection. The modules of our own
rollout engine alone (the decode graphs, exact mode end to end: `gpu` tests among them) use neither and run."""

import importlib
import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # the model tests' tiny configs

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
_platform_was_set = "VERL_PLATFORM" in os.environ
os.environ.setdefault("VERL_PLATFORM", "cpu")


def _unmet() -> str | None:
    try:
        ray = importlib.import_module("ray")
        importlib.import_module("ray.experimental")
        ray.remote  # noqa: B018 (an import-only stand-in of Ray raises here)
    except (ImportError, AttributeError) as exc:
        return f"needs a complete Ray install (pip install 'verl[verl-core]'): {exc}"
    try:
        # registers our cpu platform, also where verl found no `verl.plugins` entry point (an uninstalled checkout)
        importlib.import_module("verl_moe.engines.plugin")
        from verl.plugin.platform import PlatformRegistry
    except Exception as exc:
        return f"cannot load verl with our plugin: {type(exc).__name__}: {exc}"
    if PlatformRegistry.get("cpu") is None:
        return "our cpu platform is not in verl's registry (the verl_moe warning above says why)"
    return None


_reason = _unmet()
if _reason is not None and not _platform_was_set:
    del os.environ["VERL_PLATFORM"]  # a later test folder must not ask verl for a platform that is not there


# a module uses verl when it imports it (or what imports it: our engines but the rollout engine's own modules, the
# tools but the rollout's benches, Hydra) at top level, or uses it in a test's body (main_ppo, torchrun, Ray, the
# needs_verl fixture, vLLM, verl's modules, our engines' test setup)
_USES_VERL = re.compile(
    r"^(?:from|import)\s+(?:verl|ray|hydra|omegaconf|verl_moe\.tools(?!\.bench\.(?:rollout|exact)\b)"
    r"|verl_moe\.engines(?!\.rollout\.(?:engine|sampling)\b))\b"
    r"|main_ppo|torchrun|needs_verl|\bray\b|vllm|\bverl\.|engine_setup",
    re.M,
)


class _Unrunnable(pytest.Module):
    """A test module of this folder, reported skipped with the reason instead of imported."""

    def collect(self):
        pytest.skip(_reason)


def pytest_pycollect_makemodule(module_path, parent):
    if _reason is not None and _USES_VERL.search(module_path.read_text()):
        return _Unrunnable.from_parent(parent, path=module_path)
    return None


def pytest_collection_finish(session):
    # No test of this folder selected (`-m gpu` on a GPU machine): the cpu platform chosen above must not
    # reach the processes that the selected tests start.
    here = Path(__file__).parent
    if not _platform_was_set and not any(here in Path(item.path).parents for item in session.items):
        os.environ.pop("VERL_PLATFORM", None)
