"""`spawn(fn, world_size, *args)`: run `fn(rank, world_size, *args)` in `world_size` fresh processes
joined by a gloo process group (CPU), re-raising the first failure with its traceback.

`fn` must be a module-level function of an importable module (it is pickled for the "spawn"
start method; pytest puts the test folders on sys.path, which the children inherit). Children
run single-threaded (the CI machines have 2 cores) and with `VERL_PLATFORM=cpu`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, port: int, args: tuple) -> None:
    torch.set_num_threads(1)
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        torch_dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args) -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; raise if any rank fails."""
    env = {"VERL_PLATFORM": "cpu", "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        mp.start_processes(
            _entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True, start_method="spawn"
        )
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
