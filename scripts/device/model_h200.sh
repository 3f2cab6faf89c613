# One device call (~9.5 min): router gradient check, experts bench, the profile of our step, then the
# reduced Qwen3.5-MoE train step, ours vs VeOmni's own model in one process (8192 tokens; 16384 as 1 and 64 sequences).
# run(command="bash scripts/device/model_h200.sh", carry=[".whl"])
set -o pipefail
source scripts/device/env.sh
export TRITON_CACHE_DIR=/tmp/tc
timeout 40 python3 scripts/device/router_check.py 2>&1 | tail -4 | tee "$OUT/router_check.txt"
timeout 60 python3 -m verl_moe.tools.cli bench experts --case T16384-E256-top8-D2048-I512 --provider triton \
  --provider grouped --provider liger --provider transformers --mode fwd_bwd --reps 10 --json "$OUT/bench_experts.json" \
  2>&1 | grep -v "^\[" | tail -10 | tee "$OUT/bench_experts.txt"
timeout 100 python3 scripts/device/profile_step.py 8192 1 > "$OUT/profile_step.txt" 2>&1
timeout 320 python3 -m verl_moe.tools.cli bench model --case qwen3.5-moe-reduced-L8-T8192 \
  --case qwen3.5-moe-reduced-L8-T16384 --case qwen3.5-moe-reduced-L8-T16384-N64 --provider ours --provider veomni \
  --mode fwd_bwd --reps 5 --json "$OUT/model.json" 2>&1 | grep -v "^\[" | tail -30 | tee "$OUT/model.txt"
