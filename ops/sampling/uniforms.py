"""Counter-based uniforms: number `index` of stream `stream` is splitmix64's mix of (the mixed stream xor the
index), its top 53 bits as an fp64 in [0, 1). The same integers on every device and in any batch, so a
request's draws depend only on its own stream (the rollout derives one per request) and token count.

The op resolves as `resolve("sampling.uniforms")`: `stream_uniforms_ref` (torch int64 arithmetic, the CPU
path; ~30 elementwise kernels on a device) or `stream_uniforms_triton` (the cuda/npu default: one kernel in
uint64 arithmetic). Both equal `stream_uniform`, the host's Python-int form, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.launch import cdiv, grid_1d, launch

IMPLS = {
    "torch": "verl_moe.ops.sampling.uniforms:stream_uniforms_ref",
    "triton": "verl_moe.ops.sampling.uniforms:stream_uniforms_triton",
}

GAMMA, M1, M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    z = (z + GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * M1) & _MASK64
    z = ((z ^ (z >> 27)) * M2) & _MASK64
    return z ^ (z >> 31)


def stream_uniform(stream: int, index: int) -> float:
    """Number `index` of stream `stream` (both in [0, 2**63)) on the host: uniform in [0, 1) with 53 bits."""
    return (_mix64(_mix64(int(stream)) ^ int(index)) >> 11) * 2.0**-53


def check_uniforms_inputs(streams: torch.Tensor, index: torch.Tensor) -> None:
    """Raise ValueError unless both are int64 tensors of one shape."""
    if streams.dtype != torch.int64 or index.dtype != torch.int64 or streams.shape != index.shape:
        raise ValueError(
            f"streams and index must be int64 tensors of one shape, got {tuple(streams.shape)} {streams.dtype} "
            f"and {tuple(index.shape)} {index.dtype}"
        )


def _as_int64(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64_t(z: torch.Tensor) -> torch.Tensor:
    """`_mix64` on int64 tensors: additions and products wrap modulo 2**64 as unsigned ones would."""
    z = z + _as_int64(GAMMA)
    z = (z ^ _shr(z, 30)) * _as_int64(M1)
    z = (z ^ _shr(z, 27)) * _as_int64(M2)
    return z ^ _shr(z, 31)


def stream_uniforms_ref(streams: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`stream_uniform` elementwise on int64 tensors, on their device: fp64 in [0, 1)."""
    check_uniforms_inputs(streams, index)
    return _shr(_mix64_t(_mix64_t(streams) ^ index), 11).double() * 2.0**-53


@triton.jit
def _mix64_tl(z):
    z = z + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _uniforms_kernel(streams, index, out, N, BLOCK: tl.constexpr):
    i_p, n_p = tl.program_id(0), tl.num_programs(0)
    for i_b in range(i_p, tl.cdiv(N, BLOCK), n_p):
        o = i_b * BLOCK + tl.arange(0, BLOCK)
        m = o < N
        s = tl.load(streams + o, mask=m, other=0).to(tl.uint64, bitcast=True)
        i = tl.load(index + o, mask=m, other=0).to(tl.uint64, bitcast=True)
        bits = _mix64_tl(_mix64_tl(s) ^ i) >> 11  # unsigned: a logical shift
        tl.store(out + o, bits.to(tl.float64) * 1.1102230246251565e-16, mask=m)  # 2**-53


UNIFORM_CONFIGS = [{"BLOCK": 1024, "num_warps": 4}]


def _uniforms_grid(meta: dict) -> tuple[int]:
    return grid_1d(cdiv(meta["N"], meta["BLOCK"]))


KERNEL_LAUNCHES = {
    "_uniforms_kernel": {
        "configs": UNIFORM_CONFIGS,
        "meta": lambda shape: {},
        "grid": _uniforms_grid,
        "runtime": lambda shape: {},
        "max_shapes": ({"N": 2**20},),
    },
}


def stream_uniforms_triton(streams: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`stream_uniforms_ref` in one kernel."""
    check_uniforms_inputs(streams, index)
    streams, index = streams.contiguous(), index.contiguous()
    out = torch.empty(streams.shape, dtype=torch.float64, device=streams.device)
    if out.numel():
        launch(
            _uniforms_kernel,
            UNIFORM_CONFIGS,
            [],
            _uniforms_grid,
            streams=streams,
            index=index,
            out=out,
            N=out.numel(),
        )
    return out


__all__ = ["IMPLS", "KERNEL_LAUNCHES", "stream_uniform", "stream_uniforms_ref", "stream_uniforms_triton"]
