# One device call (~6 min): what is alive at the peak of the reduced Qwen3.5-MoE L8 step with per-layer
# checkpointing at 32,768 tokens, without and with activation offload (scripts/device/memory_peak.py), then
# the bench's timed 32K cases off / on (issue 17).
# run(command="cd .base && bash scripts/device/memory_h200.sh", carry=[".base", ".whl"])
set -o pipefail
source scripts/device/env.sh
export TRITON_CACHE_DIR=/tmp/tc
for extra in "" "--offload" ${FINE:+"--fine" "--offload --fine"}; do
  timeout 150 python3 scripts/device/memory_peak.py 32768 $extra --json "$OUT/memory_T32768${extra// /}.json" 2>&1 \
    | grep -v "^\[" | tail -34 | tee -a "$OUT/memory.txt"
done
step() { local name=$1 t=$2 tokens=$3 reps=$4; shift 4
  timeout "$t" python3 -m verl_moe.tools.cli bench model --case "qwen3.5-moe-reduced-L8-T$tokens-ckpt" --provider ours \
    --mode fwd_bwd --reps "$reps" "$@" --json "$OUT/offload_$name.json" 2>&1 \
    | grep -v "^\[" | grep -v "^[┏┃┡└│━]" | tail -6 | tee -a "$OUT/offload.txt"; }
step T32768_off 120 32768 3
step T32768_on 120 32768 3 --offload
