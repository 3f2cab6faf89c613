"""Launch plumbing shared by the GDN kernels: capped 1-D grids, chunk plans, configs.

Every kernel here runs a 1-D grid of at most GRID_LIMIT programs; each program loops over
tiles `pid, pid + num_programs, ...`, so no shape ever needs a larger grid (Ascend limit).
Configs are module constants (lists of dicts); on a device the launcher autotunes over them,
under TRITON_INTERPRET=1 it launches the first one (the interpreter cannot benchmark).
Each stage module publishes `KERNEL_LAUNCHES` (kernel name -> configs, meta, grid, max
shapes), which `tests/ops/test_kernel_rules.py` evaluates against the Ascend rules.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import device
from ..varlen import host_values

GRID_LIMIT = 65535  # Ascend: 1-D launch grids stay within 65535 programs
BT = 64  # chunk length (tokens)
BC = 16  # sub-block of the triangular solve (the smallest tl.dot tile)
MAX_KV = 128  # K and V limit: a full K row stays one live tile (BK <= 128)

# Documented largest shapes, used by the static rule check to size grids: 1M packed tokens,
# 64K sequences, 64 value heads, K = V = 128.
MAX_SHAPES = ({"T": 1 << 20, "N": 1 << 16, "H": 64, "HV": 64, "K": 128, "V": 128},)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(x: int, lo: int = BC) -> int:
    """Smallest power of two >= max(x, lo)."""
    return max(lo, 1 << max(0, int(x) - 1).bit_length())


def grid_1d(n_tiles: int) -> tuple[int]:
    """One program per tile up to GRID_LIMIT; past it the programs loop over the rest."""
    return (max(1, min(int(n_tiles), GRID_LIMIT)),)


def dot_precision(dtype: torch.dtype) -> str:
    """Precision of fp32 x fp32 tl.dot: exact ("ieee") for fp32 inputs, so fp32 mode has no TF32;
    "tf32" for 16-bit inputs on CUDA, whose error budget is set by the 16-bit storage anyway."""
    if dtype == torch.float32 or device.device_type() != "cuda":
        return "ieee"
    return "tf32"


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def dot_dtype(dtype: torch.dtype):
    """Operand type of the kernels' tl.dot: the 16-bit input type on devices (tensor cores), fp32 for
    fp32 inputs and in the interpreter, whose numpy backend stores bf16 as raw uint16 bits and
    cannot multiply it (there the dots run in fp32; storage stays in the input dtype)."""
    return tl.float32 if interpreting() else _TL_DTYPES[dtype]


@dataclass(frozen=True)
class ChunkPlan:
    """Where each 64-token chunk lives. Plain `[B, T]` input is planned as B packed sequences.

    cu_seqlens: [N+1] int32 token offsets; chunk_table: [NT, 2] int32 (sequence, chunk within it);
    chunk_offsets: [N+1] int32 index of each sequence's first chunk; N sequences, NT chunks."""

    cu_seqlens: torch.Tensor
    chunk_table: torch.Tensor
    chunk_offsets: torch.Tensor
    N: int
    NT: int

    def tile_args(self, H: int, HV: int, K: int, V: int | None, dtype: torch.dtype, l2norm: bool) -> dict:
        """The arguments every chunk-tiled kernel takes: where the chunks are, the head counts and
        dims (V omitted when None), whether q/k are l2-normalised in the kernel, and the tl.dot
        operand type and precision."""
        args = dict(
            cu_seqlens=self.cu_seqlens,
            chunk_table=self.chunk_table,
            n_chunks=self.NT,
            H=H,
            HV=HV,
            K=K,
            V=V,
            L2NORM=l2norm,
            DT=dot_dtype(dtype),
            DOT_PREC=dot_precision(dtype),
        )
        if V is None:
            del args["V"]
        return args


def make_plan(cu_seqlens: torch.Tensor | None, B: int, T: int, dev: torch.device) -> ChunkPlan:
    """Chunk bookkeeping from validated offsets (their host copy, read once per tensor)."""
    bounds = list(range(0, B * T + 1, T)) if cu_seqlens is None else host_values(cu_seqlens)
    if T == 0 and cu_seqlens is None:
        bounds = [0] * (B + 1)
    return _plan(tuple(bounds), dev)


@functools.lru_cache(maxsize=64)
def _plan(bounds: tuple, dev: torch.device) -> ChunkPlan:
    """Cached per offsets and device: repeated shapes (every plain [B, T] call) skip the host work
    and the three host-to-device copies."""
    table, offsets = [], [0]
    for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        n_chunks = cdiv(e - s, BT)
        table += [(n, c) for c in range(n_chunks)]
        offsets.append(offsets[-1] + n_chunks)

    def to_dev(x):
        return torch.tensor(x, dtype=torch.int32).to(dev)

    chunk_table = to_dev(table if table else [(0, 0)]).reshape(-1, 2)
    return ChunkPlan(to_dev(bounds), chunk_table, to_dev(offsets), len(bounds) - 1, len(table))


@functools.cache
def _autotuned(kernel, configs: tuple, key: tuple, restore: tuple):
    tconfigs = []
    for cfg in configs:
        cfg = dict(cfg)
        warps, stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 2)
        tconfigs.append(triton.Config(cfg, num_warps=warps, num_stages=stages))
    return triton.autotune(configs=tconfigs, key=list(key), restore_value=list(restore))(kernel)


def search_configs(configs: list[dict], args: dict) -> list[dict]:
    """The configs the autotuner may pick from: the first one alone in deterministic mode (the configs
    differ in block sizes, hence in the order of some reductions) and for fp32 inputs (the accuracy
    mode: its exact "ieee" tl.dot compiles to FMA loops on CUDA, ~10 s per kernel and config)."""
    if device.deterministic() or args.get("DT") is tl.float32:
        return configs[:1]
    return configs


# (kernel, deterministic mode, key values, tensor dtypes) -> the config the autotuner picked for them
_PICKED: dict[tuple, dict] = {}


def launch(kernel, configs: list[dict], key: list[str], grid, restore: tuple[str, ...] = (), **args) -> None:
    """Run `kernel` over `grid(meta) -> (programs,)`: first config when interpreting, else autotuned
    over `search_configs`.
    restore: names of tensors the kernel updates in place, which the search restores after each trial
    (else they would accumulate every benchmarked run)."""
    if interpreting():
        meta = {k: v for k, v in configs[0].items() if k not in ("num_warps", "num_stages")}
        kernel[grid({**args, **meta})](**args, **meta)
        return
    # The autotuner's own pick key (the key arguments and every tensor's dtype) plus the search mode.
    pick_key = (
        kernel,
        device.deterministic(),
        *(args[k] for k in key),
        *(v.dtype for v in args.values() if isinstance(v, torch.Tensor)),
    )
    best = _PICKED.get(pick_key)
    if best is None:
        frozen = tuple(tuple(sorted(c.items())) for c in search_configs(configs, args))
        tuned = _autotuned(kernel, frozen, tuple(key), tuple(restore))
        tuned[grid](**args)
        _PICKED[pick_key] = tuned.best_config.all_kwargs()
    else:
        # Once picked, launch the plain kernel with that config: the autotuner's per-call bookkeeping
        # is host time that, at 12 launches per fwd+bwd, can leave the GPU waiting on short kernels.
        kernel[grid](**args, **best)
