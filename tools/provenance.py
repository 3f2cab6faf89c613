"""What every tool report carries to name the run: versions, device, git sha, source hash, date, and the
environment variables that change what runs (`env`, where set)."""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import subprocess
from pathlib import Path

import torch

from ..ops import device

# environment variables that change which implementation runs (ops.dispatch reads VERL_MOE_OPS)
RECORDED_ENV = ("VERL_MOE_OPS",)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_sha() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


PACKAGE_PARTS = ("ops", "models", "engines", "tools", "configs")


def source_sha(roots: list[Path] | None = None) -> str:
    """sha256 (16 hex digits) of the package's sources (.py, .yaml), by path relative to each root and
    content: names the code a report ran where git metadata is missing or stale (a copy of the
    working tree, as the device machine gets, keeps the git sha of an older sync). roots: default
    the verl_moe subpackages."""
    if roots is None:
        # find_spec locates a subpackage without importing it (engines would import verl)
        specs = [importlib.util.find_spec(f"verl_moe.{part}") for part in PACKAGE_PARTS]
        roots = [Path(p) for spec in specs for p in spec.submodule_search_locations]
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".yaml") and "__pycache__" not in p.parts):
            digest.update(f"{root.name}/{path.relative_to(root).as_posix()}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def environment() -> dict:
    kind = device.device_type()
    name = platform.processor() or "cpu"
    if kind != "cpu":
        name = device.device_module().get_device_name()
    versions = {
        d: _version(d)
        for d in (
            "verl-moe",
            "verl",
            "transformers",
            "triton",
            "fla-core",
            "liger-kernel",
            "veomni",
            "megatron-core",
        )
    }
    versions["torch"] = torch.__version__
    versions["python"] = platform.python_version()
    env = {k: os.environ[k] for k in RECORDED_ENV if os.environ.get(k, "").strip()}
    return {
        "device": kind,
        "device_name": name,
        "versions": versions,
        "git_sha": git_sha(),
        "source_sha": source_sha(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **({"env": env} if env else {}),
    }
