#!/usr/bin/env bash
# One training step of the reduced Qwen3.5-MoE (hidden 2048, 8 layers, 64 experts top-8, vocabulary 248,320,
# bf16) on one CUDA GPU: ours against VeOmni's own model, both from the same weights in one process, at 8192
# tokens and at 16,384 tokens packed as 64 sequences -> results/model_step_L8.json; then where our step's time
# goes (torch profiler, top kernels) -> results/logs/profile_step_L8_T8192.txt, and the router's gradients
# against fp64 -> results/logs/router_check.txt. Needs `pip install '.[bench]'` and VeOmni
# (`pip install --no-deps veomni==0.1.12 blobfile tiktoken einops`; without it the veomni rows are skipped with
# the reason). About 8 minutes on an H200 (VeOmni compiles and autotunes for ~3 of them).
set -uo pipefail
cd "$(dirname "$0")/.."
export FLA_FLASH_QLA=0
mkdir -p results/logs
status=0
verl-moe bench model --case qwen3.5-moe-reduced-L8-T8192 --case qwen3.5-moe-reduced-L8-T16384-N64 \
  --provider ours --provider veomni --mode fwd_bwd --reps 5 --json results/model_step_L8.json || status=1
python benchmarks/profile_step.py 8192 1 > results/logs/profile_step_L8_T8192.txt || status=1
python benchmarks/router_check.py > results/logs/router_check.txt || status=1
exit $status
