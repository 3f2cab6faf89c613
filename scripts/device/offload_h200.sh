# One device call (~9 min): activation offload on the reduced Qwen3.5-MoE (8 layers, bf16) with activation
# checkpointing per decoder layer (issue 17): one sequence of 32,768 tokens with offload off, then on (peak
# GiB = weights + the step's peak, step ms; host_gib = the pinned host memory the offload held), then
# 131,072 and 262,144 tokens with offload on (before offload: 131,072 fit at 82 GiB, 262,144 ran out of memory).
# Each case runs in its own process, so an out-of-memory case leaves the others' reports. If 262,144 runs out
# by a little, rerun that step with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (fragmentation).
# run(command="bash scripts/device/offload_h200.sh", carry=[".whl"])
set -o pipefail
source scripts/device/env.sh
export TRITON_CACHE_DIR=/tmp/tc
step() { local name=$1 t=$2 tokens=$3 reps=$4; shift 4
  timeout "$t" python3 -m verl_moe.tools.cli bench model --case "qwen3.5-moe-reduced-L8-T$tokens-ckpt" --provider ours \
    --mode fwd_bwd --reps "$reps" "$@" --json "$OUT/offload_$name.json" 2>&1 \
    | grep -v "^\[" | grep -v "^[┏┃┡└│━]" | tail -6 | tee -a "$OUT/offload.txt"; }
step T32768_off 120 32768 3
step T32768_on 120 32768 3 --offload
step T131072_on 140 131072 1 --offload
step T262144_on 190 262144 1 --offload
