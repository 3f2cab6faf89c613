"""GDN launch plumbing: chunk plans and the GDN shape limits. The generic launch layer (capped 1-D
grids, autotune, interpreter / deterministic handling, tl.dot operand type) is `ops/common/launch.py`,
re-exported here for the stage modules.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..common.launch import (  # noqa: F401  (re-exported for the stage modules and tests)
    cdiv,
    dot_dtype,
    dot_precision,
    grid_1d,
    interpreting,
    launch,
    search_configs,
)
from ..common.launch import next_pow2 as _next_pow2

BT = 64  # chunk length (tokens)
BC = 16  # sub-block of the triangular solve (the smallest tl.dot tile)
MAX_KV = 128  # K and V limit: a full K row stays one live tile (BK <= 128)

# Documented largest shapes, used by the static rule check to size grids: 1M packed tokens,
# 64K sequences, 64 value heads, K = V = 128.
MAX_SHAPES = ({"T": 1 << 20, "N": 1 << 16, "H": 64, "HV": 64, "K": 128, "V": 128},)


def next_pow2(x: int, lo: int = BC) -> int:
    """Smallest power of two >= max(x, lo); GDN tiles start at the solve's sub-block."""
    return _next_pow2(x, lo)


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


def make_plan(bounds: Sequence[int] | None, B: int, T: int, dev: torch.device) -> ChunkPlan:
    """Chunk bookkeeping from validated offsets as host ints (None: B rows of T tokens)."""
    if bounds is None:  # B rows of T tokens (T == 0: B empty sequences)
        bounds = [b * T for b in range(B + 1)]
    return _plan(tuple(int(b) for b in bounds), dev)


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
