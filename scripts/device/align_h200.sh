# One device call (~6 min): issue 6's H200 runs. verl-moe align on the mid Qwen3-MoE preset, K=20
# (its step 0 is the one-step report): fp64 reference, fsdp2 and megatron-core (local spec), each
# with the fp32 and the bf16 router; the four workers share the GPU (--jobs 4).
# run(command="bash scripts/device/align_h200.sh", carry=[".whl"])
set -o pipefail
source scripts/device/env.sh
timeout 500 python3 -m verl_moe.tools.cli align --preset mid-qwen3-moe --jobs 4 \
  --backends reference,fsdp2,fsdp2:router=bf16,megatron,megatron:router=bf16 --steps 20 --out /tmp/k20 \
  2>&1 | grep -v -i warn | tee "$OUT/align_k20.txt"
cp /tmp/k20/report.json "$OUT/report_k20.json"; cp /tmp/k20/curves.png /tmp/k20/logp_hist.png "$OUT/"
for f in /tmp/k20/logs/*.log; do echo "== $f"; grep -v -i warn "$f" | tail -c 6000; done > "$OUT/worker_logs.txt"
nvidia-smi --query-gpu=memory.used --format=csv | tee -a "$OUT/env.txt"
# The megatron backend's own GPU test, when time is left: (passed 2026-11-29, 79 s)
# timeout 100 python3 -m pytest -m gpu tests/tools/test_align_megatron.py -p no:cacheprovider -q
