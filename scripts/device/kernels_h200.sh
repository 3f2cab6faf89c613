# One device call (~9 min): the fused ops' benches with the kernel time of each provider (`kernel_ms`:
# the sum of the call's kernels under the torch profiler, besides the synchronised wall time), then the
# model step ours vs VeOmni's own model in one process (8192 tokens; 16384 as 64 sequences).
# run(command="bash scripts/device/kernels_h200.sh", carry=[".whl"])
set -o pipefail
source scripts/device/env.sh
export TRITON_CACHE_DIR=/tmp/tc
bench() { local name=$1 t=$2; shift 2
  timeout "$t" python3 -m verl_moe.tools.cli bench "$@" --mode fwd_bwd --reps 10 --json "$OUT/bench_$name.json" 2>&1 \
    | grep -v "^\[" | grep -v "^Backend impl" | grep -v "^[┏┃┡└│━]" | tee -a "$OUT/bench_ops.txt"; }
bench norm 70 norm --case residual-T16384-D2048 --case gated-T16384-HV32-V128 --case q_strided-T16384-H16-K256
bench rope 35 rope --case qwen3.5-T16384-H16-HKV2-K256-R64
bench router 35 router --case T16384-D2048-E256-top8 --provider triton --provider torch
bench conv1d 45 conv1d --case T16384-C8192-W4-N1
timeout 345 python3 -m verl_moe.tools.cli bench model --case qwen3.5-moe-reduced-L8-T8192 \
  --case qwen3.5-moe-reduced-L8-T16384-N64 --provider ours --provider veomni --mode fwd_bwd --reps 5 \
  --json "$OUT/model.json" 2>&1 | grep -v "^\[" | grep -v "^[┏┃┡└│━]" | tail -12 | tee "$OUT/model.txt"
