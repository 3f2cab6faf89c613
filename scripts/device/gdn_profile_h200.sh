# One device call (~6 min): per-kernel CUDA time of our GDN kernels and of fla 0.6's, same process,
# same inputs, at the case where we trail fla most (B1-T16384: 6.73 vs 4.86 ms fwd+bwd, BENCHMARKS.md
# gdn Run 4), then the configs our autotuner picked. fla's first call autotunes for ~3 min.
# run(command="bash scripts/device/gdn_profile_h200.sh", carry=[".whl"])
set -o pipefail
source scripts/device/env.sh
export TRITON_CACHE_DIR=/tmp/tc
timeout 520 python3 -m verl_moe.ops.gdn.profile triton,fla B1-T16384-H16-HV32 2>&1 | grep -v -i warn | tee "$OUT/gdn_profile.txt"
