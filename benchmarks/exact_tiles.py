"""Exact mode's fixed GEMM tiles against each other on a GPU: for every candidate config, the time of the
reduced Qwen3.5-MoE's projections (one layer's worth each, summed over the model) and its LM head through
`linear_rows_triton`, and of its routed experts' forward through the pinned grouped GEMM, at a decode step's
rows (32 and 256) and a training micro-batch's (16,384; the head in its passes of 1,024 rows), per projection shape.
cuBLAS (F.linear, F.grouped_mm, batch-dependent tiles) is the anchor. Each projection and head record also says,
per candidate, whether its output equals the config exact mode uses for that width bitwise (`same_as_used`): where
configs of one K step agree, the row count could pick among them without changing a row's result. One JSON record
per line.

python benchmarks/exact_tiles.py [layers]
"""

import json
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench
from verl_moe.models import build
from verl_moe.ops.experts import grouped_gemm
from verl_moe.ops.experts.mlp import experts_mlp
from verl_moe.ops.experts.permute import moe_sort
from verl_moe.ops.linear import exact_kernel
from verl_moe.ops.logprob.exact import ROWS_PER_PASS
from verl_moe.tools.bench.model import reduced_config

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 4
dev = torch.device("cuda")
torch.manual_seed(0)
config = reduced_config(layers)
model = build(config, dtype=torch.bfloat16, device=dev)
weights = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n and "lm_head" not in n]
head = model.lm_head.weight
experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
E, K = experts.gate_up_proj.shape[0], config.num_experts_per_tok
shapes = {}  # (N, K) -> how many of the model's projections have it
for w in weights:
    shapes[tuple(w.shape)] = shapes.get(tuple(w.shape), 0) + 1
linear_configs = {}
for bm, bn, bk, warps, stages in (
    (64, 64, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (128, 64, 64, 4, 4),
    (128, 128, 64, 4, 4),
    (128, 128, 64, 8, 4),
    (128, 256, 64, 8, 4),
    (64, 64, 128, 4, 3),
    (64, 128, 128, 4, 3),
    # narrow tiles of the same K step: more tiles at a decode step's few rows
    (16, 64, 64, 4, 4),
    (32, 64, 64, 4, 4),
    (32, 32, 64, 4, 4),
    (64, 32, 64, 4, 4),
):
    linear_configs[f"{bm}x{bn}x{bk}w{warps}s{stages}"] = {
        "BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8, "num_warps": warps, "num_stages": stages
    }  # fmt: skip


gemm = exact_kernel.linear_rows_triton


def emit(**record):
    print(json.dumps(record), flush=True)


emit(device=torch.cuda.get_device_name(), smem=torch.cuda.get_device_properties(0).shared_memory_per_block_optin)


def bench(fn, *args, **kwargs) -> float:
    return do_bench(lambda: fn(*args, **kwargs))


def same_as_used(a, w, out_dtype=None) -> dict[str, bool]:
    """Per candidate config: its output bitwise equal to that of the config exact mode takes for w's width."""
    used = gemm(a, w, out_dtype=out_dtype)
    return {
        name: torch.equal(gemm(a, w, out_dtype=out_dtype, config=cfg), used) for name, cfg in linear_configs.items()
    }


def measure(rows: int) -> None:
    x = torch.randn(rows, config.hidden_size, device=dev, dtype=torch.bfloat16)
    head_rows = x[: min(rows, ROWS_PER_PASS)]
    passes = rows // head_rows.shape[0]
    for (N, Kd), count in shapes.items():
        a, w = torch.randn(rows, Kd, device=dev, dtype=torch.bfloat16), torch.randn(N, Kd, device=dev).bfloat16()
        times = {"cublas": count * bench(F.linear, a, w)}
        for name, cfg in linear_configs.items():
            times[name] = count * bench(gemm, a, w, config=cfg)
        emit(op="projection", rows=rows, N=N, K=Kd, count=count, ms=times, same_as_used=same_as_used(a, w))
    times = {"cublas": passes * bench(F.linear, head_rows, head)}
    for name, cfg in linear_configs.items():
        times[name] = passes * bench(gemm, head_rows, head, out_dtype=torch.float32, config=cfg)
    emit(op="head", rows=rows, ms=times, same_as_used=same_as_used(head_rows, head, torch.float32))
    idx = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(rows)])
    routing = moe_sort(idx.reshape(-1), E)
    w = torch.rand(rows * K, device=dev)
    gu, dn = experts.gate_up_proj.detach(), experts.down_proj.detach()
    with torch.no_grad():
        times = {"grouped_mm": bench(experts_mlp, x, gu, dn, w, routing, K)}
        for n, cfg in enumerate(grouped_gemm.ROWS_CONFIGS):
            times[f"rows[{n}]"] = bench(experts_mlp, x, gu, dn, w, routing, K, (cfg,))
        emit(op="experts", rows=rows, ms=times)


for rows in (32, 256, 16384):
    measure(rows)
