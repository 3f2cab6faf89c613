"""A `cpu` platform for verl's platform registry, so verl's own workers run on CPU with gloo.

verl resolves its platform once per process (`verl.plugin.platform.get_platform`): from
`VERL_PLATFORM`, else by probing the registered platforms, else falling back to `nvidia`.
On a machine without accelerator that fallback makes every verl worker ask for CUDA and NCCL.
`PlatformCPU` is registered under the name `cpu` by `verl_moe.engines.plugin`; it is never
auto-detected (so installing the plugin changes nothing on GPU/NPU hosts) and is selected with
`VERL_PLATFORM=cpu`.

What it maps:
- device `cpu`, collective backend `gloo`, seeds through `torch.manual_seed`;
- the device module is `torch.cpu` plus the memory-statistics functions verl's workers call
  (`max_memory_allocated`, `mem_get_info`, ...), which `torch.cpu` lacks; they report 0 bytes
  (CPU has no caching allocator) and host memory from psutil;
- one "accelerator" in Ray is one CPU: a `RayResourcePool` bundle is `{"CPU": max_colocate_count,
  ray_resource_name(): 1}`, which with the name "CPU" collapses to `{"CPU": 1}`, and each of the
  (up to max_colocate_count) workers colocated in it asks for `num_cpus=1/max_colocate_count`
  (`ray_resource_options`). So verl's `use_gpu=True` pools need one CPU per trainer rank, which a
  small machine grants.

Three verl functions cannot be served by a platform, so each is wrapped, on this platform only:

- `ResourcePoolManager._check_resource_available` (main_ppo's trainer) counts Ray's "GPU"/"NPU"
  resources whatever the platform and raises "Total available GPUs 0 is less than total desired
  GPUs N" on CPU, although the pools' bundles ask for `ray_resource_name()` = "CPU".
  `install_cpu_resource_check` counts free Ray CPUs instead. Upstream fix
  (`verl/single_controller/ray/base.py`): count `get_platform().ray_resource_name()`.
- `initialize_global_process_group_ray` (verl's Ray workers) and `initialize_global_process_group`
  (its SPMD trainers started by torchrun, e.g. `verl.trainer.sft_trainer`) both build the backend string
  `cpu:gloo,<device>:<backend>`, which torch rejects for device `cpu` ("Duplicate device type cpu").
  `install_cpu_process_group_fix` makes both use plain `gloo`. Upstream fix (`verl/utils/distributed.py`,
  where both strings are built): one helper returning `get_nccl_backend()` when `get_device_name() == "cpu"`,
  else `f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"`, called by both functions.
"""

from __future__ import annotations

import functools
import os
import types
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psutil
import torch
import torch.distributed
from verl.plugin.platform import PlatformBase

PLATFORM_NAME = "cpu"


def _zero_bytes(*args, **kwargs) -> int:
    return 0


def _noop(*args, **kwargs) -> None:
    return None


def _host_mem_get_info(*args, **kwargs) -> tuple[int, int]:
    mem = psutil.virtual_memory()
    return mem.available, mem.total


def _build_cpu_device_module() -> types.ModuleType:
    """`torch.cpu` plus the allocator-statistics API verl calls on `get_torch_device()`."""
    module = types.ModuleType("verl_moe_cpu_device")
    for name in ("current_device", "device_count", "is_available", "synchronize", "Stream", "Event"):
        setattr(module, name, getattr(torch.cpu, name))
    module.set_device = _noop
    module.manual_seed = torch.manual_seed
    module.manual_seed_all = torch.manual_seed
    module.empty_cache = _noop
    module.reset_peak_memory_stats = _noop
    module.reset_accumulated_memory_stats = _noop
    module.set_per_process_memory_fraction = _noop
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        setattr(module, name, _zero_bytes)
    module.mem_get_info = _host_mem_get_info
    # verl's FlopsCounter looks the name up in its table of peak FLOPS ("CPU" is an entry)
    module.get_device_name = lambda *args, **kwargs: "CPU"
    return module


CPU_DEVICE_MODULE = _build_cpu_device_module()


class PlatformCPU(PlatformBase):
    """verl platform for CPU-only hosts: gloo collectives, one CPU per Ray "accelerator"."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        # Never auto-detected: a host's accelerator platform must win the probe. Select with VERL_PLATFORM=cpu.
        return False

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # verl's Worker exports this variable; nothing reads it on CPU.
        return "VERL_CPU_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        # Ray refuses "CPU" inside `resources`; it must go through num_cpus.
        return {"num_cpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def cpu_platform_selected() -> bool:
    """True when this process asked verl for the cpu platform (`VERL_PLATFORM=cpu`)."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME


def install_cpu_process_group_fix() -> None:
    """Make verl's two process-group initialisers in `verl.utils.distributed` use plain `gloo` on the
    cpu platform: `initialize_global_process_group_ray` (Ray workers; an explicit `backend` passes
    through) and `initialize_global_process_group` (SPMD trainers under torchrun; it takes no backend).
    Any other platform calls verl's functions unchanged.

    Must run before a caller binds either name: `verl.workers.engine_workers` imports the Ray one at
    module level, the SFT trainer imports the SPMD one when `run_sft` starts; the plugin loads during
    `import verl`, before both. Idempotent.
    """
    import verl.utils.distributed as verl_distributed

    ray_init = verl_distributed.initialize_global_process_group_ray
    if not getattr(ray_init, "_verl_moe_cpu_fix", False):

        @functools.wraps(ray_init)
        def initialize_global_process_group_ray(timeout_second=None, backend=None):
            from verl.utils.device import get_device_name

            if backend is None and get_device_name() == "cpu":
                backend = "gloo"
            return ray_init(timeout_second=timeout_second, backend=backend)

        initialize_global_process_group_ray._verl_moe_cpu_fix = True
        verl_distributed.initialize_global_process_group_ray = initialize_global_process_group_ray

    spmd_init = verl_distributed.initialize_global_process_group
    if not getattr(spmd_init, "_verl_moe_cpu_fix", False):

        @functools.wraps(spmd_init)
        def initialize_global_process_group(timeout_second=36000):
            from verl.utils.device import get_device_name

            if get_device_name() != "cpu":
                return spmd_init(timeout_second=timeout_second)
            # verl's function with the backend it should have built; its set_device is a no-op on CPU
            torch.distributed.init_process_group(
                backend="gloo",
                timeout=timedelta(seconds=timeout_second),
                init_method=os.environ.get("DIST_INIT_METHOD", None),
            )
            return int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

        initialize_global_process_group._verl_moe_cpu_fix = True
        verl_distributed.initialize_global_process_group = initialize_global_process_group


def install_cpu_resource_check() -> None:
    """Make verl's `ResourcePoolManager._check_resource_available` count free Ray CPUs (one per
    worker, what the pools' bundles ask for) when the current platform is this one; any other
    platform keeps verl's GPU/NPU count. Idempotent.

    Raises (from the check, on this platform): ValueError naming both counts and the setting to raise.
    """
    from verl.single_controller.ray.base import ResourcePoolManager

    original = ResourcePoolManager._check_resource_available
    if getattr(original, "_verl_moe_cpu_fix", False):
        return

    @functools.wraps(original)
    def _check_resource_available(self):
        from verl.utils.device import get_device_name

        if get_device_name() != "cpu":
            return original(self)
        import ray

        free = ray.available_resources().get("CPU", 0)
        required = self.get_n_gpus()
        if free < required:
            raise ValueError(
                f"Ray has {free:g} free CPUs, the resource pools need {required} (one per worker on the cpu "
                "platform): raise ray_kwargs.ray_init.num_cpus or lower trainer.n_gpus_per_node"
            )

    _check_resource_available._verl_moe_cpu_fix = True
    ResourcePoolManager._check_resource_available = _check_resource_available
