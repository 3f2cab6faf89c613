# One device call (~5 min): issue 6's H200 runs. verl-moe align on the mid Qwen3-MoE preset, K=20
# (its step 0 is the one-step report): fp64 reference, fsdp2 and megatron-core (local spec), each
# with the fp32 and the bf16 router. run(command="bash scripts/device/align_h200.sh", carry=[".whl"])
set -o pipefail
source scripts/device/env.sh
timeout 480 python3 -m verl_moe.tools.cli align --preset mid-qwen3-moe \
  --backends reference,fsdp2,fsdp2:router=bf16,megatron,megatron:router=bf16 --steps 20 --out /tmp/k20 \
  2>&1 | grep -v -i warn | tee "$OUT/align_k20.txt"
cp /tmp/k20/report.json "$OUT/report_k20.json"; cp /tmp/k20/curves.png /tmp/k20/logp_hist.png "$OUT/"
for f in /tmp/k20/logs/*.log; do echo "== $f"; grep -v -i warn "$f" | tail -c 6000; done > "$OUT/worker_logs.txt"
