#!/usr/bin/env bash
# Every op's bench at Qwen3.5-35B-A3B shapes on one CUDA GPU: our kernels against the anchors (fla, Liger,
# transformers) and the torch reference, all providers of an op in one process (`verl-moe bench`), one report
# per op (per case for gdn) in results/. Needs `pip install '.[bench]'`. About 15 minutes on an H200 from a cold
# Triton cache (fla's first GDN call compiles and autotunes for minutes). Afterwards:
# `python scripts/benchmarks_md.py` rewrites BENCHMARKS.md. A failed correctness check exits 1 at the end
# (the report is still written).
set -uo pipefail
cd "$(dirname "$0")/.."
export FLA_FLASH_QLA=0  # fla's Triton GDN path, the one its own benchmarks time
status=0
run() { verl-moe bench "$@" || status=1; }

# gdn: one case per process, so one slow compile or failure costs only its case
for case in B1-T4096-H16-HV32 B1-T16384-H16-HV32 B4-T8192-H16-HV32 varlen8-T16384-H16-HV32; do
  run gdn --case "$case" --reps 10 --json "results/ops_gdn_$case.json"
done
run norm --case residual-T16384-D2048 --case gated-T16384-HV32-V128 --case q_strided-T16384-H16-K256 \
  --mode fwd_bwd --reps 10 --json results/ops_norm.json
run rope --case qwen3.5-T16384-H16-HKV2-K256-R64 --mode fwd_bwd --reps 10 --json results/ops_rope.json
run conv1d --case T16384-C8192-W4-N1 --case T16384-C8192-W4-N64 --mode fwd_bwd --reps 10 --json results/ops_conv1d.json
run router --case T16384-D2048-E256-top8 --mode fwd_bwd --reps 10 --json results/ops_router.json
run attention --provider varlen --provider torch --provider transformers_sdpa --mode fwd_bwd --reps 10 \
  --json results/ops_attention.json
run experts --case T16384-E256-top8-D2048-I512 --provider triton --provider grouped --provider liger \
  --provider transformers --mode fwd_bwd --reps 10 --json results/ops_experts.json
run logprob --reps 10 --json results/ops_logprob.json
exit $status
