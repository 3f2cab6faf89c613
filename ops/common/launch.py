"""The one launch layer of verl_moe's Triton kernels (GDN, log-prob head, norm, rope, conv1d, MoE).

Every kernel runs a 1-D grid of at most GRID_LIMIT programs; each program loops over tiles
`pid, pid + num_programs, ...`, so no shape needs a larger grid (Ascend limit). Configs are module
constants (lists of dicts, `num_warps` / `num_stages` beside the constexprs); on a device `launch`
autotunes over them, under TRITON_INTERPRET=1 it launches the first one (the interpreter cannot
benchmark), and in deterministic mode or for fp32 inputs it searches only the first one.
Each kernel module publishes `KERNEL_LAUNCHES` (kernel name -> configs, meta, grid, max shapes),
which `tests/ops/test_kernel_rules.py` evaluates against the Ascend rules.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from .. import device
from . import runtime
from .runtime import interpreting  # noqa: F401  (re-exported: the kernels' modules import it from here)

GRID_LIMIT = 65535  # Ascend: 1-D launch grids stay within 65535 programs


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(x: int, lo: int = 16) -> int:
    """Smallest power of two >= max(x, lo)."""
    return max(lo, 1 << max(0, int(x) - 1).bit_length())


def grid_1d(n_tiles: int) -> tuple[int]:
    """One program per tile up to GRID_LIMIT; past it the programs loop over the rest."""
    return (max(1, min(int(n_tiles), GRID_LIMIT)),)


def stages_fit(config: dict, bk: int, element_bytes: int = 2) -> bool:
    """Whether a GEMM config's pipelined operand tiles (num_stages x (BM + BN) x bk elements) fit in the
    shared memory one block may use on this device (never on cpu / npu, where callers keep small tiles)."""
    need = config["num_stages"] * (config["BM"] + config["BN"]) * bk * element_bytes
    return 0 < need <= device.shared_memory_per_block()


def dot_precision(dtype: torch.dtype) -> str:
    """Precision of fp32 x fp32 tl.dot: exact ("ieee") for fp32 inputs, so fp32 mode has no TF32;
    "tf32" for 16-bit inputs on CUDA, whose error budget is set by the 16-bit storage anyway."""
    if dtype == torch.float32 or device.device_type() != "cuda":
        return "ieee"
    return "tf32"


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def dot_dtype(dtype: torch.dtype):
    """Operand type of tl.dot: the 16-bit input type on devices (tensor cores), fp32 for fp32 inputs
    and in the interpreter, whose numpy backend stores bf16 as raw uint16 bits and cannot multiply
    it (triton-lang/triton#11584; there the dots run in fp32, storage stays in the input dtype)."""
    return tl.float32 if interpreting() else _TL_DTYPES[dtype]


@functools.cache
def _autotuned(kernel, configs: tuple, key: tuple, restore: tuple):
    tconfigs = []
    for cfg in configs:
        cfg = dict(cfg)
        warps, stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 2)
        tconfigs.append(triton.Config(cfg, num_warps=warps, num_stages=stages))
    return triton.autotune(configs=tconfigs, key=list(key), restore_value=list(restore))(kernel)


def search_configs(configs: list[dict], args: dict) -> list[dict]:
    """The configs the autotuner may pick from: the first one alone in deterministic mode (configs
    differ in block sizes, hence in the order of some reductions) and for fp32 inputs (the accuracy
    mode: its exact "ieee" tl.dot compiles to FMA loops on CUDA, slow to compile for every kernel and config)."""
    if runtime.deterministic() or args.get("DT") is tl.float32:
        return configs[:1]
    return configs


def launch(
    kernel, configs: list[dict], key: list[str], grid: Callable | tuple, restore: tuple[str, ...] = (), **args
) -> None:
    """Run `kernel(**args)` over `grid` (a tuple, or `meta -> (programs,)`): the first config when
    interpreting, else autotuned over `search_configs` on the `key` arguments.
    restore: names of tensors the kernel updates in place, which the search restores after each trial
    (else they would accumulate every benchmarked run)."""
    grid_fn = grid if callable(grid) else (lambda meta: grid)
    if interpreting():
        meta = {k: v for k, v in configs[0].items() if k not in ("num_warps", "num_stages")}
        kernel[grid_fn({**args, **meta})](**args, **meta)
        return
    # The autotuner's own pick key (the key arguments and every tensor's dtype) plus the search mode and
    # the configs offered: a caller that pins one config never gets another caller's pick.
    pick_key = (
        kernel,
        runtime.deterministic(),
        *(id(c) for c in configs),
        *(args[k] for k in key),
        *(v.dtype for v in args.values() if isinstance(v, torch.Tensor)),
    )
    best = runtime.AUTOTUNE_PICKS.get(pick_key)
    if best is None:
        frozen = tuple(tuple(sorted(c.items())) for c in search_configs(configs, args))
        tuned = _autotuned(kernel, frozen, tuple(key), tuple(restore))
        tuned[grid_fn](**args)
        runtime.AUTOTUNE_PICKS[pick_key] = tuned.best_config.all_kwargs()
    else:
        # Once picked, launch the plain kernel with that config: the autotuner's per-call bookkeeping
        # is host time that, at a dozen launches per layer, can leave the GPU waiting on short kernels.
        kernel[grid_fn](**args, **best)
