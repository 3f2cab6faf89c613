# One device call (~9 min): the GPU tests of the new kernels, then each op's bench (fwd+bwd) at Qwen3.5 shapes.
# run(command="bash scripts/device/ops_h200.sh", carry=[".whl"])
set -o pipefail
source scripts/device/env.sh
export TRITON_CACHE_DIR=/tmp/tc
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_norm.py tests/ops/test_rope.py \
  tests/ops/test_attention.py tests/ops/test_conv1d.py tests/ops/test_grouped_gemm.py tests/ops/test_router.py \
  tests/ops/test_experts.py 2>&1 | tail -25 | tee "$OUT/pytest_gpu_ops.txt"
bench() { local name=$1 t=$2; shift 2
  timeout "$t" python3 -m verl_moe.tools.cli bench "$@" --mode fwd_bwd --reps 10 --json "$OUT/bench_$name.json" 2>&1 \
    | grep -v "^\[" | tail -14 | tee -a "$OUT/bench_ops.txt"; }
bench norm 80 norm --case residual-T16384-D2048 --case gated-T16384-HV32-V128 --case q_strided-T16384-H16-K256
bench rope 40 rope --case qwen3.5-T16384-H16-HKV2-K256-R64
bench conv1d 60 conv1d --case T16384-C8192-W4-N1 --case T16384-C8192-W4-N64
bench attention 60 attention --provider varlen --provider torch --provider transformers_sdpa
bench experts 70 experts --case T16384-E256-top8-D2048-I512
bench router 40 router --case T16384-D2048-E256-top8
