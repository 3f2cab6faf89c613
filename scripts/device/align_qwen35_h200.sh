# One device call (<= 10 min, not yet run): issue 18's Qwen3.5-MoE divergence study on the H200.
# verl-moe align on the mid Qwen3.5-MoE preset (8 layers, 6 GatedDeltaNet + 2 gated attention,
# hidden 1024, 64 experts top-8, shared expert), K=40 GRPO steps (past the reported ~35), the fp64
# reference and fsdp2 / veomni / megatron-core in bf16 compute, every two backends compared
# (--all-pairs); the four workers share the GPU (--jobs 4). ROUTER=bf16 runs the same with the
# bf16 router on the three trained backends (default fp32). STEPS=N shortens the run.
# run(command="bash scripts/device/align_qwen35_h200.sh", carry=[".whl"])
#   (megatron's GatedDeltaNet needs fla on the device: .whl/fla_core-*.whl is in the carry)
set -o pipefail
source scripts/device/env.sh
ROUTER=${ROUTER:-fp32}
STEPS=${STEPS:-40}
R=""; [ "$ROUTER" = fp32 ] || R=":router=$ROUTER"
DIR=/tmp/q35_k${STEPS}_$ROUTER
python3 -c "import fla, megatron.core as m; print('fla', fla.__version__, 'megatron-core', m.__version__)" | tee -a "$OUT/env.txt"
timeout 540 python3 -m verl_moe.tools.cli align --preset mid-qwen3.5-moe --jobs 4 --all-pairs --steps "$STEPS" \
  --backends "reference,fsdp2$R,veomni$R,megatron$R" --out "$DIR" \
  2>&1 | grep -v -i warn | tee "$OUT/align_q35_$ROUTER.txt"
cp "$DIR/report.json" "$OUT/report_q35_$ROUTER.json"; cp "$DIR"/*.png "$OUT/" 2>/dev/null
for f in "$DIR"/logs/*.log; do echo "== $f"; grep -v -i warn "$f" | tail -c 4000; done > "$OUT/worker_logs.txt"
nvidia-smi --query-gpu=memory.used --format=csv | tee -a "$OUT/env.txt"
