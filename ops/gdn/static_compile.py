"""Static sm_90 compile of our GDN kernels: registers, spill and shared memory per config (a tool for
tuning, not part of the op; runs on a machine without a GPU).

`python -m verl_moe.ops.gdn.static_compile KERNEL [NAME=VALUE ...] [--fp32]` compiles `KERNEL` (a name
from a stage module's `KERNEL_LAUNCHES`) for every config in its list, at Qwen3.5 shapes (H=16, HV=32,
K=V=128), bf16 inputs with TF32 dots (--fp32: fp32 inputs, exact dots), q/k l2norm on, other flags
off unless NAME=VALUE sets them (e.g. `USE_H0=True`). Like the JIT, it marks every pointer 16-byte
aligned: without that the loads are not vectorised and every kernel appears to spill. Reads the cubin with Triton's bundled cuobjdump.
The device runs its own Triton version, whose register allocation can differ: confirm on the device.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from . import l2norm, output, solve, state, wy

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
SHAPE = {"H": 16, "HV": 32, "K": 128, "V": 128, "T": 16384, "N": 1}
# Pointer arguments that hold fp32 data; every other pointer is the bf16 input dtype.
FP32_POINTERS = set("gc rk rq dgam dgl ht dht h0 dh0 vn dA_log_tok A_log dt_bias a g".split())


def _jit_fn(kernel):
    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn
    return kernel


def _signature(fn, constexprs: dict, fp32: bool = False) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ("n_seqs", "n_chunks", "n_rows"):
            sig[name] = "i32"
        elif name == "scale":
            sig[name] = "fp32"
        elif name in ("cu_seqlens", "chunk_table", "chunk_offsets"):
            sig[name] = "*i32"
        else:
            sig[name] = "*fp32" if fp32 or name in FP32_POINTERS else "*bf16"
    return sig


def resource_usage(fn, constexprs: dict, num_warps: int, num_stages: int, fp32: bool = False) -> dict:
    """{"regs", "spill_bytes", "smem_kib"} of one sm_90 build of the jit function `fn` (fp32: every
    tensor fp32, as for fp32 inputs)."""
    sig = _signature(fn, constexprs, fp32)
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
    source = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=aligned)
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 128), options={"num_warps": num_warps, "num_stages": num_stages}
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    return {
        "regs": int(re.search(r"REG:(\d+)", usage).group(1)),
        "spill_bytes": int(re.search(r"STACK:(\d+)", usage).group(1)),
        "smem_kib": compiled.metadata.shared // 1024,
    }


def kernel_report(
    name: str, overrides: dict | None = None, fp32: bool = False, first_only: bool = False
) -> list[tuple[dict, dict]]:
    """(config, resource usage) for every config of the launched kernel `name` (first_only: its first,
    the one fp32 inputs and deterministic mode use); fp32: as built for fp32 inputs (exact "ieee" dots)."""
    for module in (state, output, wy, solve, l2norm):
        spec = getattr(module, "KERNEL_LAUNCHES", {}).get(name)
        if spec:
            break
    else:
        raise ValueError(f"{name!r} is not in any GDN stage's KERNEL_LAUNCHES")
    fn = _jit_fn(getattr(module, name))
    rows = []
    for config in spec["configs"][:1] if first_only else spec["configs"]:
        config = dict(config)
        num_warps, num_stages = config.pop("num_warps", 4), config.pop("num_stages", 2)
        values = {**SHAPE, "G": SHAPE["HV"] // SHAPE["H"], "EPS": 1e-6, **spec["meta"](SHAPE), **config}
        values.update(DT=tl.float32 if fp32 else tl.bfloat16, DOT_PREC="ieee" if fp32 else "tf32", L2NORM=True)
        constexprs = {}
        for arg in fn.arg_names:
            if arg in values:
                constexprs[arg] = values[arg]
            elif arg.isupper():  # the remaining constexpr flags: off
                constexprs[arg] = False
        constexprs.update(overrides or {})
        usage = resource_usage(fn, constexprs, num_warps, num_stages, fp32)
        rows.append(({**config, "num_warps": num_warps, "num_stages": num_stages}, usage))
    return rows


if __name__ == "__main__":
    overrides = {}
    for arg in sys.argv[2:]:
        if arg == "--fp32":
            continue
        key, value = arg.split("=")
        overrides[key] = int(value) if value.isdigit() else value == "True"
    for config, usage in kernel_report(sys.argv[1], overrides, fp32="--fp32" in sys.argv[2:]):
        print(sys.argv[1], config, usage, flush=True)
