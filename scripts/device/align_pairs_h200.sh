# One device call (~5 min): issue 6's direct engine-vs-megatron comparison on the H200. verl-moe align
# on the mid Qwen3-MoE preset, K=20, fsdp2 and megatron-core in bf16 and fp32 (fp32 router), every
# two backends compared (--all-pairs). run(command="bash scripts/device/align_pairs_h200.sh", carry=[".whl"])
set -o pipefail
source scripts/device/env.sh
timeout 380 python3 -m verl_moe.tools.cli align --preset mid-qwen3-moe --jobs 4 --all-pairs --steps 20 \
  --backends reference,fsdp2,megatron,fsdp2:dtype=fp32,megatron:dtype=fp32 --out /tmp/p20 \
  2>&1 | grep -v -i warn | tee "$OUT/align_pairs.txt"
cp /tmp/p20/report.json "$OUT/report_pairs.json"; cp /tmp/p20/curves.png "$OUT/curves_pairs.png"
for f in /tmp/p20/logs/*.log; do echo "== $f"; grep -v -i warn "$f" | tail -c 3000; done > "$OUT/worker_logs.txt"
