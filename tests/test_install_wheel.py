"""`pip install verl-moe` without our install script: build the wheel, install it into a fresh venv
(no system site-packages; only torch is installed first, the CPU wheel this machine uses, so the
resolver does not pull a CUDA build), resolving every other dependency from the package index
under scripts/constraints.txt. Then verl's worker and trainer modules import, the `verl.plugins`
entry point registers our engines and cpu platform, and the YAML configs ship as package data.

Before `verl[verl-core]` in pyproject.toml, plain `verl` left out uvicorn, fastapi, cachetools and
TransferQueue, and `import verl.workers.engine_workers` failed. Needs a package index: skipped,
saying so, when pip cannot download verl from one. Minutes (it installs ray, transformers, ...):
marked slow.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIRS = ("verl_moe", "engines", "integrations", "models", "ops", "configs", "tools")
PACKAGE_FILES = ("pyproject.toml", "setup.py", "README.md")
CHECK = """
import os
import verl.trainer.main_ppo
import verl.workers.engine_workers
from verl.plugin.platform import PlatformRegistry
from verl.workers.engine import EngineRegistry
import verl_moe.configs
from verl_moe.engines.selector import MoeEngineSelector

assert EngineRegistry.get_engine_cls("language_model", "fsdp2") is MoeEngineSelector
assert PlatformRegistry.get("cpu") is not None
configs = os.path.dirname(verl_moe.configs.__file__)
for name in ("recipe/tiny_cpu.yaml", "recipe/tiny_cpu_veomni.yaml", "scale/tiny.yaml", "engine/moe_fsdp2.yaml"):
    assert os.path.isfile(os.path.join(configs, name)), name
print("ok", verl_moe.configs.__file__)
"""


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


def _check(result: subprocess.CompletedProcess, what: str) -> None:
    assert result.returncode == 0, f"{what} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"


def _build_wheel(tmp_path) -> str:
    """The wheel of a copy of the package sources (an in-tree build would write build/ and
    *.egg-info into the checkout)."""
    source = tmp_path / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for folder in PACKAGE_DIRS:
        shutil.copytree(os.path.join(ROOT, folder), source / folder, ignore=ignore)
    for name in PACKAGE_FILES:
        shutil.copy(os.path.join(ROOT, name), source / name)
    dist = tmp_path / "dist"
    command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist)]
    _check(_run([*command, str(source)]), "pip wheel")
    (wheel,) = [name for name in os.listdir(dist) if name.startswith("verl_moe-") and name.endswith(".whl")]
    return str(dist / wheel)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_wheel_installs_into_a_fresh_venv(tmp_path):
    probe = _run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(tmp_path / "probe"), "verl==0.9.1"],
        timeout=300,
    )
    if probe.returncode != 0:
        pytest.skip(f"pip cannot download verl==0.9.1 from a package index: {probe.stderr.strip()[-300:]}")
    wheel = _build_wheel(tmp_path)
    venv = tmp_path / "venv"
    _check(_run([sys.executable, "-m", "venv", str(venv)]), "venv")
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    torch_version = torch.__version__.split("+")[0]
    _check(_run([*pip, f"torch=={torch_version}"], env=env), f"pip install torch=={torch_version}")
    constraints = os.path.join(ROOT, "scripts", "constraints.txt")
    _check(_run([*pip, "-c", constraints, wheel], env=env), "pip install the wheel")
    result = _run(
        [python, "-W", "ignore", "-c", CHECK],
        env={**env, "VERL_PLATFORM": "cpu", "RAY_AUTH_MODE": "disabled"},
        cwd=tmp_path,  # not the checkout: the import must come from the venv
    )
    _check(result, "imports in the fresh venv")
    assert str(venv) in result.stdout, result.stdout
