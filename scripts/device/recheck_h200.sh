# One device call (~8 min): the reworked kernels (norm backward, rope, conv1d backward, router) through their
# GPU tests and benches, then the model step ours vs VeOmni in one process (8192 tokens; 64 x 256).
# run(command="bash scripts/device/recheck_h200.sh", carry=[".whl"])
set -o pipefail
source scripts/device/env.sh
export TRITON_CACHE_DIR=/tmp/tc
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_norm.py tests/ops/test_rope.py \
  tests/ops/test_conv1d.py tests/ops/test_router.py 2>&1 | tail -6 | tee "$OUT/pytest_gpu.txt"
bench() { local name=$1 t=$2; shift 2
  timeout "$t" python3 -m verl_moe.tools.cli bench "$@" --mode fwd_bwd --reps 10 --json "$OUT/bench_$name.json" 2>&1 \
    | grep -v "^\[" | grep -v "^Backend impl" | tail -9 | tee -a "$OUT/bench_ops.txt"; }
bench norm 60 norm --case residual-T16384-D2048 --case gated-T16384-HV32-V128 --case q_strided-T16384-H16-K256
bench rope 30 rope --case qwen3.5-T16384-H16-HKV2-K256-R64
bench conv1d 45 conv1d --case T16384-C8192-W4-N1 --case T16384-C8192-W4-N64
bench router 30 router --case T16384-D2048-E256-top8 --provider triton --provider torch
timeout 230 python3 -m verl_moe.tools.cli bench model --case qwen3.5-moe-reduced-L8-T8192 \
  --case qwen3.5-moe-reduced-L8-T16384-N64 --provider ours --provider veomni --mode fwd_bwd --reps 5 \
  --json "$OUT/model.json" 2>&1 | grep -v "^\[" | tail -12 | tee "$OUT/model.txt"
