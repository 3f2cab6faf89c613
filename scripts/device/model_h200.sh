# One device call (~3 min): the reduced Qwen3.5-MoE train step, ours vs transformers + fla.
# run(command="bash scripts/device/model_h200.sh", carry=[".whl"])
set -o pipefail
source scripts/device/env.sh
timeout 330 python3 -m verl_moe.tools.cli bench model --case qwen3.5-moe-reduced-L8-T8192 --mode fwd_bwd --reps 5 \
  --json "$OUT/model.json" 2>&1 | tail -30 | tee "$OUT/model.txt"
