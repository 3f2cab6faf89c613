# One device call (~9 min): issue 3's H200 runs. `verl-moe bench gdn` one case per command (a case cut
# by its limit loses only itself; fla's first call autotunes for ~3 min, so the first case gets the
# longest limit; fla compiles its varlen kernels anew). The GPU test subset below is off (~90 s).
# run(command="bash scripts/device/gdn_h200.sh", carry=[".whl"])
set -o pipefail
source scripts/device/env.sh
export TRITON_CACHE_DIR=/tmp/tc
# timeout 150 python3 -m pytest -m gpu tests/ops/test_gdn.py -p no:cacheprovider -q -s -k "not fla" 2>&1 | tail -40 | tee "$OUT/pytest_gdn.txt"
for case in B1-T4096-H16-HV32 B1-T16384-H16-HV32 B4-T8192-H16-HV32 varlen8-T16384-H16-HV32; do
  # Run 5 (fresh machine): 70 s cut B4-T8192 and 110 s cut varlen before fla's fwd_bwd rows.
  case $case in B1-T4096*) limit=220 ;; B1-T16384*) limit=80 ;; B4*) limit=100 ;; varlen*) limit=120 ;; esac
  timeout $limit python3 -m verl_moe.tools.cli bench gdn --case $case --reps 10 --json "$OUT/gdn_$case.json" 2>&1 | tail -20 | tee -a "$OUT/bench_gdn.txt"
done
timeout 60 python3 -m verl_moe.tools.cli bench gdn --case B1-T65536-H16-HV32 --provider triton --provider fla --reps 5 2>&1 | tail -12 | tee -a "$OUT/bench_gdn.txt"
