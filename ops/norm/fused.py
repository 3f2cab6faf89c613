"""Triton RMSNorm: plain, (1 + weight) and silu-gated, optionally fused with the residual add before it.

Forward, one launch: per row h = x (+ residual, rounded to x.dtype as the model's bf16 add),
rstd = rsqrt(mean(h^2) + eps) in fp32, y with the reference's rounding points (`reference.py`);
writes y, h (residual only) and rstd [rows] fp32; one program per block of rows. Backward, one launch
and a torch sum: dx (which is also d residual), d gate, and d weight as per-program fp32 partial sums
[programs, D] (no atomics) that torch sums; about two persistent programs a core (a fixed set of row
blocks each), their row loop software-pipelined through shared memory, d weight kept in registers.
Saved for backward: x (or h) and gate in their dtype, plus rstd, the one fp32 tensor (4 bytes a row;
recomputing it would read every row once more).

Rows wider than MAX_BD loop over D blocks: the forward reads a row twice (statistic, then output);
the backward first writes each row's mean(g * x_hat) (g = d loss / d x_hat) with
`_rms_norm_bwd_dot_kernel`, so the main kernel can keep d weight of one D block in registers while it
walks its rows (Qwen3.5's widths, 2048 and below, take the one-block path).

Ascend rules: power-of-two tiles, 1-D grids <= 65535 with grid-stride loops, no atomics (each partial
row of d weight has one program), `if` only on constexprs. Row strides: q/k norms get a view of a
projection ([B, T, H, K] slice of the last dim); leading dims that flatten into one row stride are
read in place, anything else is copied.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import device
from ..common.launch import cdiv, grid_1d, interpreting, launch, next_pow2
from .reference import check_norm_inputs

MAX_BD = 4096  # widest D block; wider rows loop (every config's TILE is >= MAX_BD, so >= 1 row a tile)
# TILE = elements of one [TILE // BD rows, BD] block; the first config is the interpreter's and
# deterministic mode's: small and safe.
FWD_CONFIGS = [
    {"TILE": 4096, "num_warps": 4},
    {"TILE": 4096, "num_warps": 8},
    {"TILE": 8192, "num_warps": 8},
    {"TILE": 16384, "num_warps": 8},
    {"TILE": 16384, "num_warps": 16},
]
# Backward: persistent programs (`_bwd_programs`) whose row loop is pipelined over STAGES blocks in
# shared memory. sm_90 builds (Triton 3.9, D 128 / 256 / 2048 / 8192), bf16: the first config 113-128
# registers a thread (two programs a core), <= 33 KiB shared, no spills (fp32 inputs: 100-165, no
# spills); TILE 4096 / 3 stages 96-170; TILE 8192 / 16 warps 98-128 with no spills (fp32: 40 bytes
# gated, and D 8192 needs 256 KiB of shared memory, which the autotuner skips); TILE 8192 / 8 warps
# 141-250 (fp32: spills 8 bytes gated). TILE 4096 with 4 warps takes 187-255 and spills gated.
BWD_CONFIGS = [
    {"TILE": 4096, "STAGES": 2, "num_warps": 8},
    {"TILE": 4096, "STAGES": 3, "num_warps": 8},
    {"TILE": 8192, "STAGES": 3, "num_warps": 16},
    {"TILE": 8192, "STAGES": 2, "num_warps": 8},
]
DOT_CONFIGS = [{"TILE": 4096, "num_warps": 4}, {"TILE": 8192, "num_warps": 8}]
# Backward programs: each writes one [D] fp32 partial of d weight that torch sums again (8 D bytes), so
# it owns ROWS_PER_PROGRAM rows or more (each row moves >= 6 D bytes: the partials cost <= 4%); and
# PROGRAMS_PER_CORE a core, so that they all run at once (two programs of <= 128 registers fit a core)
# or in two equal waves, never a short last wave of programs that each walk many rows.
ROWS_PER_PROGRAM = 32
PROGRAMS_PER_CORE = 2
# Documented largest shapes for the static rule check: 32M rows (1M tokens x 32 heads), D up to 8192.
MAX_SHAPES = (
    {"n_rows": 1 << 25, "D": 8192},
    {"n_rows": 1 << 25, "D": 2048},
    {"n_rows": 1 << 25, "D": 128},
    {"n_rows": 1, "D": 72},
)
AUTOTUNE_KEY = ["D", "UNIT_OFFSET", "HAS_GATE", "HAS_RES"]
# Triton 3.9's interpreter converts fp32 -> bf16 by truncation (`interpreter.cast_impl` hands
# `_convert_float` no rounding mode), where GPUs and torch round to nearest even; under the interpreter
# the kernels round with integer ops instead, so CPU tests see the device's rounding points.
_RTNE_BY_BITS = tl.constexpr(interpreting())


@triton.jit
def _to(b, T: tl.constexpr):
    """fp32 block b as dtype T, rounded to nearest even."""
    if _RTNE_BY_BITS and T == tl.bfloat16:
        u = b.to(tl.uint32, bitcast=True)
        u = u + (0x7FFF + ((u >> 16) & 1))
        return (u >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return b.to(T)


@triton.jit
def _load_rows(p, stride, o_r, o_d, m):
    """[rows, BD] fp32 block of a row-major tensor with row stride `stride` (int64 row offsets o_r)."""
    return tl.load(p + o_r[:, None] * stride + o_d[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def _fwd_h(x, s_x, res, s_res, o_r, o_d, m, HAS_RES: tl.constexpr):
    """Block of h = x (+ residual, rounded to x.dtype as the model's add) in fp32."""
    b_h = _load_rows(x, s_x, o_r, o_d, m)
    if HAS_RES:
        b_h = _to(b_h + _load_rows(res, s_res, o_r, o_d, m), x.dtype.element_ty).to(tl.float32)
    return b_h


@triton.jit
def _fwd_store(
    b_h,
    b_rstd,
    w,
    gate,
    s_gate,
    y,
    h,
    o_r,
    o_d,
    m,
    D: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    HAS_GATE: tl.constexpr,
    HAS_RES: tl.constexpr,
    MID: tl.constexpr,
):
    """Write one block of y (and of h): the reference's rounding points; MID is the dtype of
    `weight * x_hat.to(x.dtype)` (torch's promotion of weight and x)."""
    if HAS_RES:
        tl.store(h + o_r[:, None] * D + o_d[None, :], _to(b_h, h.dtype.element_ty), mask=m)
    b_w = tl.load(w + o_d, mask=o_d < D, other=0.0).to(tl.float32)[None, :]
    b_xh = b_h * b_rstd[:, None]
    if UNIT_OFFSET:
        b_y = b_xh * (1.0 + b_w)
    else:
        b_y = _to(b_w * _to(b_xh, y.dtype.element_ty).to(tl.float32), MID).to(tl.float32)
        if HAS_GATE:
            b_z = _load_rows(gate, s_gate, o_r, o_d, m)
            b_y = b_y * b_z * tl.sigmoid(b_z)
    tl.store(y + o_r[:, None] * D + o_d[None, :], _to(b_y, y.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_fwd_kernel(
    x,
    s_x,
    res,
    s_res,
    gate,
    s_gate,
    w,
    y,
    h,
    rstd,
    n_rows,
    eps,
    D: tl.constexpr,
    BD: tl.constexpr,
    TILE: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    HAS_GATE: tl.constexpr,
    HAS_RES: tl.constexpr,
    MID: tl.constexpr,
):
    """One program per block of TILE // BD rows (1-D grid, looping): x / residual / gate rows with
    row strides s_*, unit column stride; y, h [rows, D] contiguous; rstd [rows] fp32."""
    i_p = tl.program_id(0)
    for i_t in range(i_p, tl.cdiv(n_rows, TILE // BD), tl.num_programs(0)):
        o_r = (i_t * (TILE // BD) + tl.arange(0, TILE // BD)).to(tl.int64)
        m_r = o_r < n_rows
        if BD >= D:  # the whole row is one block: read it once
            o_d = tl.arange(0, BD)
            m = m_r[:, None] & (o_d < D)[None, :]
            b_h = _fwd_h(x, s_x, res, s_res, o_r, o_d, m, HAS_RES)
            b_rstd = tl.rsqrt(tl.sum(b_h * b_h, 1) / D + eps)
            _fwd_store(b_h, b_rstd, w, gate, s_gate, y, h, o_r, o_d, m, D, UNIT_OFFSET, HAS_GATE, HAS_RES, MID)
        else:
            b_ss = tl.zeros([TILE // BD], dtype=tl.float32)
            for i_d in range(0, D, BD):
                o_d = i_d + tl.arange(0, BD)
                m = m_r[:, None] & (o_d < D)[None, :]
                b_h = _fwd_h(x, s_x, res, s_res, o_r, o_d, m, HAS_RES)
                b_ss += tl.sum(b_h * b_h, 1)
            b_rstd = tl.rsqrt(b_ss / D + eps)
            for i_d in range(0, D, BD):
                o_d = i_d + tl.arange(0, BD)
                m = m_r[:, None] & (o_d < D)[None, :]
                # h again from x and residual (not from the h just written, which another thread may hold)
                b_h = _fwd_h(x, s_x, res, s_res, o_r, o_d, m, HAS_RES)
                _fwd_store(b_h, b_rstd, w, gate, s_gate, y, h, o_r, o_d, m, D, UNIT_OFFSET, HAS_GATE, HAS_RES, MID)
        tl.store(rstd + o_r, b_rstd, mask=m_r)


@triton.jit
def _bwd_terms(
    b_x,
    b_dy,
    b_z,
    b_w,
    b_rstd,
    x,
    UNIT_OFFSET: tl.constexpr,
    HAS_GATE: tl.constexpr,
    MID: tl.constexpr,
):
    """fp32 blocks of x, dy, gate (read only when HAS_GATE) and weight [1, BD] -> x_hat, dy_n (d loss / d
    of the normalised value times the weight: dy, or dy * silu(gate)), g = d loss / d x_hat and d gate
    (dy when not gated)."""
    b_xh = b_x * b_rstd[:, None]
    b_dz = b_dy
    if HAS_GATE:
        b_s = tl.sigmoid(b_z)
        # the forward's pre-gate value as it rounded it; silu'(z) = s (1 + z (1 - s))
        b_y0 = _to(b_w * _to(b_xh, x.dtype.element_ty).to(tl.float32), MID).to(tl.float32)
        b_dz = b_dy * b_y0 * b_s * (1.0 + b_z * (1.0 - b_s))
        b_dy = b_dy * b_z * b_s
    if UNIT_OFFSET:
        b_g = b_dy * (1.0 + b_w)
    else:
        b_g = b_dy * b_w
    return b_xh, b_dy, b_g, b_dz


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_bwd_dot_kernel(
    dy,
    x,
    s_x,
    gate,
    s_gate,
    w,
    rstd,
    dot,
    n_rows,
    D: tl.constexpr,
    BD: tl.constexpr,
    TILE: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    HAS_GATE: tl.constexpr,
    MID: tl.constexpr,
):
    """Rows wider than one block: one program per block of TILE // BD rows (1-D grid, looping) writes
    dot [rows] fp32 = mean over D of g * x_hat."""
    i_p = tl.program_id(0)
    for i_t in range(i_p, tl.cdiv(n_rows, TILE // BD), tl.num_programs(0)):
        o_r = (i_t * (TILE // BD) + tl.arange(0, TILE // BD)).to(tl.int64)
        m_r = o_r < n_rows
        b_rstd = tl.load(rstd + o_r, mask=m_r, other=0.0)
        b_c = tl.zeros([TILE // BD], dtype=tl.float32)
        for i_d in range(0, D, BD):
            o_d = i_d + tl.arange(0, BD)
            m = m_r[:, None] & (o_d < D)[None, :]
            b_w = tl.load(w + o_d, mask=o_d < D, other=0.0).to(tl.float32)[None, :]
            b_dy = _load_rows(dy, D, o_r, o_d, m)
            b_z = b_dy  # read only when gated
            if HAS_GATE:
                b_z = _load_rows(gate, s_gate, o_r, o_d, m)
            b_xh, b_dy, b_g, b_dz = _bwd_terms(
                _load_rows(x, s_x, o_r, o_d, m), b_dy, b_z, b_w, b_rstd, x, UNIT_OFFSET, HAS_GATE, MID
            )
            b_c += tl.sum(b_g * b_xh, 1)
        tl.store(dot + o_r, b_c / D, mask=m_r)


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_bwd_kernel(
    dy,
    x,
    s_x,
    gate,
    s_gate,
    w,
    rstd,
    dot,
    dh,
    dx,
    dgate,
    dw,
    n_rows,
    D: tl.constexpr,
    BD: tl.constexpr,
    TILE: tl.constexpr,
    STAGES: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    HAS_GATE: tl.constexpr,
    HAS_DH: tl.constexpr,
    MID: tl.constexpr,
):
    """Program i_p of P (1-D grid, `_bwd_programs`: about two a core) takes the blocks of TILE // BD rows
    i_p, i_p + P, ...: dx (+ dh, the gradient reaching h directly) and dgate [rows, D] contiguous, and
    its d weight partial dw[i_p] [D] fp32. dy, dh contiguous; x / gate with row strides. dot: the
    per-row means of `_rms_norm_bwd_dot_kernel` when D > BD (unused otherwise).

    The programs are persistent, so they hide the memory latency themselves: the row loop is software
    pipelined over STAGES blocks (the loads of the next STAGES - 1 blocks go to shared memory while
    one is computed; `tl.range(num_stages=...)` pipelines loads that feed no tl.dot, the launch option
    does not). d weight is summed elementwise in a [TILE // BD, BD] fp32 tile and reduced over its rows
    once, at the end: no reduction across warps per block for it."""
    i_p = tl.program_id(0)
    for i_d in range(0, D, BD):  # one block unless D > BD
        o_d = i_d + tl.arange(0, BD)
        # loaded as a row, not a [1, BD] tile: a 2-D load of one row gets its own layout, which then
        # spreads to the blocks' arithmetic (unvectorised, with layout conversions)
        b_w = tl.load(w + o_d, mask=o_d < D, other=0.0).to(tl.float32)[None, :]
        b_dw = tl.zeros([TILE // BD, BD], dtype=tl.float32)
        for i_t in tl.range(i_p, tl.cdiv(n_rows, TILE // BD), tl.num_programs(0), num_stages=STAGES):
            o_r = (i_t * (TILE // BD) + tl.arange(0, TILE // BD)).to(tl.int64)
            m_r = o_r < n_rows
            m = m_r[:, None] & (o_d < D)[None, :]
            # every load of the block before the first reduction (one round trip when not pipelined)
            b_rstd = tl.load(rstd + o_r, mask=m_r, other=0.0)
            b_x = _load_rows(x, s_x, o_r, o_d, m)
            b_dy = _load_rows(dy, D, o_r, o_d, m)
            b_z = b_dy  # read only when gated
            if HAS_GATE:
                b_z = _load_rows(gate, s_gate, o_r, o_d, m)
            if HAS_DH:
                b_dh = _load_rows(dh, D, o_r, o_d, m)
            if BD < D:
                b_c = tl.load(dot + o_r, mask=m_r, other=0.0)
            b_xh, b_dy, b_g, b_dz = _bwd_terms(b_x, b_dy, b_z, b_w, b_rstd, x, UNIT_OFFSET, HAS_GATE, MID)
            if BD >= D:
                b_c = tl.sum(b_g * b_xh, 1) / D
            b_dx = b_rstd[:, None] * (b_g - b_xh * b_c[:, None])
            if HAS_DH:
                b_dx += b_dh
            tl.store(dx + o_r[:, None] * D + o_d[None, :], _to(b_dx, dx.dtype.element_ty), mask=m)
            if HAS_GATE:
                tl.store(dgate + o_r[:, None] * D + o_d[None, :], _to(b_dz, dgate.dtype.element_ty), mask=m)
            b_dw += b_dy * b_xh
        tl.store(dw + i_p * D + o_d, tl.sum(b_dw, 0), mask=o_d < D)


def _meta(shape: dict) -> dict:
    return {"BD": min(next_pow2(shape["D"]), MAX_BD)}


def _rows_grid(meta: dict) -> tuple[int]:
    return grid_1d(cdiv(meta["n_rows"], meta["TILE"] // meta["BD"]))


def _bwd_grid(meta: dict) -> tuple[int]:
    return (meta["n_programs"],)


def _cores() -> int:
    """Streaming multiprocessors (vector cores) of this process's device; 1 on CPU (the interpreter)."""
    return _cores_of(device.device_module().current_device()) if device.is_accelerator() else 1


@functools.cache
def _cores_of(index: int) -> int:
    props = device.device_module().get_device_properties(index)
    return int(getattr(props, "multi_processor_count", 32))


def _bwd_programs(n_rows: int, cores: int) -> int:
    """Backward programs: ROWS_PER_PROGRAM rows each or more, at most PROGRAMS_PER_CORE per core."""
    return max(1, min(cdiv(n_rows, ROWS_PER_PROGRAM), PROGRAMS_PER_CORE * cores, 65535))


def _runtime(shape: dict) -> dict:
    return {"n_rows": shape["n_rows"]}


def _bwd_runtime(shape: dict) -> dict:
    return {"n_rows": shape["n_rows"], "n_programs": _bwd_programs(shape["n_rows"], 132)}


def _launches(grid, runtime, configs) -> dict:
    return {"configs": configs, "meta": _meta, "grid": grid, "runtime": runtime, "max_shapes": MAX_SHAPES}


KERNEL_LAUNCHES = {
    "_rms_norm_fwd_kernel": _launches(_rows_grid, _runtime, FWD_CONFIGS),
    "_rms_norm_bwd_dot_kernel": _launches(_rows_grid, _runtime, DOT_CONFIGS),
    "_rms_norm_bwd_kernel": _launches(_bwd_grid, _bwd_runtime, BWD_CONFIGS),
}


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _mid(x: torch.Tensor, weight: torch.Tensor):
    """Triton dtype of the reference's `weight * x_hat.to(x.dtype)` (torch's type promotion)."""
    return _TL_DTYPES[torch.promote_types(weight.dtype, x.dtype)]


def rms_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    gate: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
    unit_offset: bool,
    out_shape: torch.Size,
    configs: list[dict] = FWD_CONFIGS,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """x, gate, residual [rows, D] (unit column stride) -> y, h (residual only) of out_shape in
    x.dtype, rstd [rows] fp32. configs: what the autotuner may pick from."""
    n_rows, D = x.shape
    y = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    h = torch.empty_like(y) if residual is not None else None
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows > 0:
        launch(
            _rms_norm_fwd_kernel,
            configs,
            AUTOTUNE_KEY,
            _rows_grid,
            x=x,
            s_x=x.stride(0),
            res=residual,
            s_res=0 if residual is None else residual.stride(0),
            gate=gate,
            s_gate=0 if gate is None else gate.stride(0),
            w=weight,
            y=y,
            h=h,
            rstd=rstd,
            n_rows=n_rows,
            eps=eps,
            D=D,
            UNIT_OFFSET=unit_offset,
            HAS_GATE=gate is not None,
            HAS_RES=residual is not None,
            MID=_mid(x, weight),
            **_meta({"D": D}),
        )
    return y, h, rstd


def rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    gate: torch.Tensor | None,
    rstd: torch.Tensor,
    dh: torch.Tensor | None,
    unit_offset: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """dy, dh [rows, D] contiguous; x (or h), gate [rows, D] unit column stride; rstd [rows] fp32 ->
    dx [rows, D] x.dtype (includes dh), dgate [rows, D] gate.dtype (or None), dweight [D] weight.dtype."""
    n_rows, D = x.shape
    dx = torch.empty((n_rows, D), dtype=x.dtype, device=x.device)
    dgate = None if gate is None else torch.empty((n_rows, D), dtype=gate.dtype, device=x.device)
    if n_rows == 0:
        return dx, dgate, torch.zeros_like(weight)
    meta = _meta({"D": D})
    common = dict(
        dy=dy,
        x=x,
        s_x=x.stride(0),
        gate=gate,
        s_gate=0 if gate is None else gate.stride(0),
        w=weight,
        rstd=rstd,
        n_rows=n_rows,
        D=D,
        UNIT_OFFSET=unit_offset,
        HAS_GATE=gate is not None,
        MID=_mid(x, weight),
        **meta,
    )
    dot = None
    if D > meta["BD"]:
        dot = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        launch(_rms_norm_bwd_dot_kernel, DOT_CONFIGS, ["D", "UNIT_OFFSET", "HAS_GATE"], _rows_grid, dot=dot, **common)
    n_programs = _bwd_programs(n_rows, _cores())
    partial = torch.empty((n_programs, D), dtype=torch.float32, device=x.device)
    launch(
        _rms_norm_bwd_kernel,
        BWD_CONFIGS,
        ["D", "UNIT_OFFSET", "HAS_GATE", "HAS_DH"],
        _bwd_grid({"n_programs": n_programs}),
        dot=dot,
        dh=dh,
        dx=dx,
        dgate=dgate,
        dw=partial,
        HAS_DH=dh is not None,
        **common,
    )
    return dx, dgate, partial.sum(0).to(weight.dtype)


@dataclass(frozen=True)
class NormOptions:
    eps: float
    unit_offset: bool
    first_config: bool = False  # forward in FWD_CONFIGS[0] alone, whatever the autotuner would pick


def _as_rows(t: torch.Tensor, D: int) -> torch.Tensor:
    """t [..., D] as [rows, D] with unit column stride: a view when its leading dims flatten into one
    row stride (e.g. a slice of a projection's last dim), else a contiguous copy."""
    if t.stride(-1) == 1:
        try:
            return t.view(-1, D)
        except RuntimeError:
            pass
    return t.reshape(-1, D).contiguous()


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, gate, residual, opts: NormOptions):
        D = x.shape[-1]
        x2 = _as_rows(x, D)
        g2 = None if gate is None else _as_rows(gate, D)
        r2 = None if residual is None else _as_rows(residual, D)
        configs = FWD_CONFIGS[:1] if opts.first_config else FWD_CONFIGS
        y, h, rstd = rms_norm_fwd(x2, weight, g2, r2, opts.eps, opts.unit_offset, x.shape, configs)
        # h is saved as the output itself (backward views it as rows): a view made here reads as a leaf
        # that requires grad once h is an output (activation offload tells such views apart by _base)
        ctx.save_for_backward(x2 if h is None else h, weight, g2, rstd)
        ctx.opts, ctx.shape, ctx.has_res = opts, x.shape, residual is not None
        ctx.set_materialize_grads(False)
        return y if h is None else (y, h)

    @staticmethod
    def backward(ctx, dy, dh=None):
        xs, weight, g2, rstd = ctx.saved_tensors
        D = ctx.shape[-1]
        xs = xs.view(-1, D)
        dy2 = torch.zeros(xs.shape, dtype=xs.dtype, device=xs.device) if dy is None else dy.reshape(-1, D).contiguous()
        dh2 = None if dh is None else dh.reshape(-1, D).contiguous()
        dx, dgate, dw = rms_norm_bwd(dy2, xs, weight, g2, rstd, dh2, ctx.opts.unit_offset)
        dx = dx.view(ctx.shape)
        dgate = None if dgate is None else dgate.view(ctx.shape)
        # h = x + residual: both receive the gradient of h
        return dx, dw, dgate, dx if ctx.has_res else None, None


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    unit_offset: bool = False,
    gate: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    first_config: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim in Triton, `rms_norm_ref`'s contract and rounding (the dispatched `norm`).

    Args:
        x: [..., D] fp32 / bf16 / fp16; rows may be strided (unit column stride), else copied.
        weight: [D] fp32 / bf16 / fp16; (1 + weight) when unit_offset (Qwen3.5), else weight.
        eps: added to mean(x^2).
        unit_offset: Qwen3.5's (1 + weight); not with gate.
        gate: optional [..., D]; output times silu(gate) (GatedDeltaNet's norm).
        residual: optional [..., D] in x.dtype; normalises h = x + residual (added in x.dtype).
        first_config: run the forward in its first config only (each row's reduction then has one
            order in every call and process: exact mode, `rms_norm_exact`).
    Returns:
        [..., D] in x.dtype; with residual (norm(h), h).
    Raises:
        ValueError: shapes or dtypes (fp64 runs the torch implementation), devices, unit_offset with gate.
    """
    check_norm_inputs(x, weight, gate, residual)
    if gate is not None and unit_offset:
        raise ValueError("gated rms_norm uses the plain weight convention; unit_offset=True is not defined")
    tensors = {"x": x, "weight": weight, "gate": gate, "residual": residual}
    for name, t in tensors.items():
        if t is not None and t.dtype not in _KERNEL_DTYPES:
            raise ValueError(f"triton rms_norm: {name} dtype {t.dtype} is not fp32/bf16/fp16 (use impl='torch')")
        if t is not None and t.device != x.device:
            raise ValueError(f"triton rms_norm: {name} is on {t.device}, x on {x.device}")
    if x.shape[-1] == 0:
        raise ValueError("triton rms_norm: D = x.shape[-1] must be >= 1")
    opts = NormOptions(float(eps), bool(unit_offset), bool(first_config))
    return RMSNormFunction.apply(x, weight, gate, residual, opts)
