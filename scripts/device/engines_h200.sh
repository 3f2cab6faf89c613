# One device call (~8 min): our engines on the GPU with GDN layers. The tiny Qwen3.5-MoE
# (GatedDeltaNet on our Triton kernels) through fsdp2 and veomni at world 1 (one GPU: expert
# parallelism needs 2 ranks) against the fp64 reference, fp32 and bf16; then the model bench.
# Fifth session: the align part ran (3 steps, four backends, VERL_MOE_DETERMINISTIC=1 so each kernel
# compiles one config: 95 s on a fresh machine) and was ALIGNED; the model bench ran ours alone (within a 170 s limit).
# Needs .whl/veomni (scripts/device/fetch_wheels.sh). run(command="bash scripts/device/engines_h200.sh", carry=[".whl"])
set -o pipefail
source scripts/device/env.sh
python3 -c "import veomni; print('veomni', veomni.__version__)" 2>&1 | tail -3 | tee "$OUT/veomni_import.txt"
timeout 200 python3 -m verl_moe.tools.cli align --preset tiny-qwen3.5-moe --jobs 4 --all-pairs --steps 5 \
  --backends reference,fsdp2:world=1:dtype=fp32,veomni:world=1:dtype=fp32,fsdp2:world=1,veomni:world=1 --out /tmp/eng \
  2>&1 | grep -v -i warn | tee "$OUT/align_engines.txt"
cp /tmp/eng/report.json "$OUT/report_engines.json"
timeout 330 python3 -m verl_moe.tools.cli bench model --case qwen3.5-moe-reduced-L8-T8192 --mode fwd_bwd --reps 5 \
  --json "$OUT/model.json" 2>&1 | tail -30 | tee "$OUT/model.txt"
