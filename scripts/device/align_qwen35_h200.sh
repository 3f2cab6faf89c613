# One device call (<= 10 min): issue 18's Qwen3.5-MoE divergence study on the H200.
# verl-moe align on the mid Qwen3.5-MoE preset (8 layers, 6 GatedDeltaNet + 2 gated attention,
# hidden 1024, 64 experts top-8, shared expert), K=40 GRPO steps (past the reported ~35): the fp64
# reference and fsdp2 / veomni / megatron-core in bf16 compute with the fp32 router, fsdp2 and
# megatron with the bf16 router, and both in fp32 compute for contrast; every two backends compared
# (--all-pairs); all workers share the GPU (--jobs). STEPS=N shortens the run, BACKENDS= replaces the list.
# run(command="cd .base && bash scripts/device/align_qwen35_h200.sh", carry=[".base", ".whl"])
#   (megatron's GatedDeltaNet needs fla on the device: .whl/fla_core-*.whl is in the carry)
set -o pipefail
source scripts/device/env.sh
STEPS=${STEPS:-40}
BACKENDS=${BACKENDS:-reference,fsdp2,veomni,megatron,fsdp2:router=bf16,megatron:router=bf16,fsdp2:dtype=fp32,megatron:dtype=fp32}
JOBS=$(($(echo "$BACKENDS" | tr ',' '\n' | wc -l) - 1))
DIR=/tmp/q35_k$STEPS
python3 -c "import fla, megatron.core as m; print('fla', fla.__version__, 'megatron-core', m.__version__)" | tee -a "$OUT/env.txt"
timeout 550 python3 -m verl_moe.tools.cli align --preset mid-qwen3.5-moe --jobs "$JOBS" --all-pairs --steps "$STEPS" \
  --backends "$BACKENDS" --out "$DIR" 2>&1 | grep -v -i warn | tee "$OUT/align_q35_k$STEPS.txt"
cp "$DIR/report.json" "$OUT/report_q35_k$STEPS.json"; cp "$DIR"/*.png "$OUT/" 2>/dev/null
for f in "$DIR"/logs/*.log; do echo "== $f"; grep -v -i warn "$f" | tail -c 3000; done > "$OUT/worker_logs.txt"
nvidia-smi --query-gpu=memory.used --format=csv | tee -a "$OUT/env.txt"
