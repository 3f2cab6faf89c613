# Activation offload and checkpoint tiles on the reduced Qwen3.5-MoE L8 (bf16) on one H200 (issue 17).
# PHASE=32k (~5 min): what is alive at the step's peak at 32,768 tokens (scripts/device/memory_peak.py) for
#   per-layer checkpointing, tiles + offload (the engines' offload) and tiles alone; then the bench's timed
#   32K step for: per-layer checkpointing (the baseline), offload with tiles, offload with per-layer units,
#   tiles without offload.
# PHASE=long (~8 min): tiles alone and 16K tiles with offload at 32K, then 262,144 tokens with and without
#   offload.
# PHASE=attn (~4 min): scripts/device/attention_memory.py at 32,768 tokens (the ways to run long causal
#   GQA attention: time, memory), then what is alive at the 32K peak for per-layer checkpointing and
#   offload with tiles.
# PHASE=verify (~10 min): the GPU attention and norm tests, what is alive at the 32K peak (per-layer
#   checkpointing; offload with tiles), the timed 32K step for the four unit / offload choices, then
#   262,144 tokens with offload and tiles, and with per-layer checkpointing alone.
# PHASE=final (~4 min): the GPU tile / offload tests, then a third timed 32K pair (offload with tiles,
#   per-layer checkpointing).
# PHASE=262k (~7 min): 262,144 tokens with offload (the engines' tiles), then with per-layer checkpointing
#   alone; a second timed 32K step of per-layer checkpointing and of offload with tiles.
# Each case runs in its own process, so an out-of-memory case leaves the others' reports.
# run(command="cd .base && PHASE=32k bash scripts/device/offload_h200.sh", carry=[".base", ".whl"])
set -o pipefail
source scripts/device/env.sh
export TRITON_CACHE_DIR=/tmp/tc
peak() { local tag="$*"; tag=${tag// /}
  timeout 150 python3 scripts/device/memory_peak.py "$@" --json "$OUT/memory_${tag//-/}.json" 2>&1 \
  | grep -v "^\[" | tail -24 | tee -a "$OUT/memory.txt"; }
step() { local name=$1 t=$2 tokens=$3 reps=$4; shift 4
  timeout "$t" python3 -m verl_moe.tools.cli bench model --case "qwen3.5-moe-reduced-L8-T$tokens-ckpt" --provider ours \
    --mode fwd_bwd --reps "$reps" "$@" --json "$OUT/offload_$name.json" 2>&1 \
    | grep -v "^\[" | grep -v "^[┏┃┡└│━]" | grep -v "Warning\|_warn_once" | tail -4 | tee -a "$OUT/offload.txt"; }
if [ "${PHASE:-32k}" = attn ]; then
  timeout 200 python3 scripts/device/attention_memory.py --tokens 32768 --json "$OUT/attention_T32768.json" 2>&1 \
    | grep -v "Warning\|warn" | tee -a "$OUT/attention.txt"
  peak 32768 --units layer
  peak 32768 --offload
elif [ "$PHASE" = final ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/models/test_checkpoint_tiles.py \
    tests/models/test_activation_offload.py 2>&1 | tail -4 | tee "$OUT/pytest_gpu.txt"
  step T32768_offload_tiles_run3 120 32768 5 --offload
  step T32768_layer_run3 120 32768 5
elif [ "$PHASE" = verify ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_attention.py tests/ops/test_norm.py \
    2>&1 | tail -4 | tee "$OUT/pytest_gpu.txt"
  peak 32768 --units layer
  peak 32768 --offload
  step T32768_layer 150 32768 5
  step T32768_offload_tiles 150 32768 5 --offload
  step T32768_tiles 150 32768 5 --checkpoint-units tiles
  step T32768_offload_layer 150 32768 5 --offload --checkpoint-units layer
  step T262144_offload_tiles 200 262144 1 --offload
  step T262144_layer 200 262144 1
elif [ "$PHASE" = 32k ]; then
  peak 32768 --units layer
  peak 32768 --offload
  peak 32768 --units tiles
  step T32768_layer 100 32768 5
  step T32768_offload_tiles 100 32768 5 --offload
  step T32768_offload_layer 100 32768 5 --offload --checkpoint-units layer
  step T32768_tiles 100 32768 5 --checkpoint-units tiles
elif [ "$PHASE" = 262k ]; then
  step T262144_offload_tiles 200 262144 1 --offload
  step T262144_layer 200 262144 1
  step T32768_layer_run2 120 32768 5
  step T32768_offload_tiles_run2 120 32768 5 --offload
else
  step T32768_tiles 100 32768 5 --checkpoint-units tiles
  step T32768_offload_tiles16k 100 32768 5 --offload --tile-tokens 16384
  step T262144_layer 150 262144 1
  step T262144_offload_tiles 170 262144 1 --offload
fi
