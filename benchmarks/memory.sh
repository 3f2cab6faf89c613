#!/usr/bin/env bash
# Activation memory of long sequences on one CUDA GPU: the reduced Qwen3.5-MoE (8 layers, bf16), one sequence,
# activation checkpointing per decoder layer or in 16,384-token tiles, with and without activation offload.
# Each case in its own process (an out-of-memory case leaves the others' reports), one report each in results/:
#   memory_L8_T32768_layer_N, memory_L8_T32768_offload_tiles_N  the A/B pair, REPEAT times (default 3)
#   memory_L8_T32768_offload_layer, memory_L8_T32768_tiles      the other two unit / offload choices
#   memory_L8_T262144_layer, memory_L8_T262144_offload_tiles    262,144 tokens (needs ~70 GiB of GPU memory,
#                                                               ~30 GiB of pinned host memory with offload)
# then what is alive at the 32K peak (results/logs/memory_peak_*) and the long-attention micro
# (results/logs/attention_T32768.json). About 12 minutes on an H200. Needs `pip install .`.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p results/logs
status=0
step() { local name=$1 tokens=$2 reps=$3; shift 3
  verl-moe bench model --case "qwen3.5-moe-reduced-L8-T$tokens-ckpt" --provider ours --mode fwd_bwd --reps "$reps" \
    "$@" --json "results/memory_L8_T${tokens}_$name.json" || status=1; }
for i in $(seq "${REPEAT:-3}"); do
  step "layer_$i" 32768 5
  step "offload_tiles_$i" 32768 5 --offload
done
step offload_layer 32768 5 --offload --checkpoint-units layer
step tiles 32768 5 --checkpoint-units tiles
step layer 262144 1
step offload_tiles 262144 1 --offload
python benchmarks/memory_peak.py 32768 --units layer --json results/logs/memory_peak_L8_T32768_layer.json \
  > results/logs/memory_peak_L8_T32768.txt || status=1
python benchmarks/memory_peak.py 32768 --offload --json results/logs/memory_peak_L8_T32768_offload_tiles.json \
  >> results/logs/memory_peak_L8_T32768.txt || status=1
python benchmarks/attention_memory.py --tokens 32768 --json results/logs/attention_T32768.json || status=1
exit $status
