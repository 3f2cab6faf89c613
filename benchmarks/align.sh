#!/usr/bin/env bash
# `verl-moe align` on one CUDA GPU: the same weights and batches through the fp64 reference, our engines and
# megatron-core, every backend worker sharing the GPU (--jobs). Each run's report.json and plots go to
# align_out/<name>/, then to results/<name>.json and results/<name>.png (the K-step curves) for
# `python scripts/benchmarks_md.py`. Needs `pip install '.[bench,megatron]'` (megatron-core >= 0.17 on Python
# 3.12; its GatedDeltaNet uses fla) and VeOmni (`pip install --no-deps veomni==0.1.12 blobfile tiktoken
# einops`). About 20 minutes on an H200. RUNS= picks some of: engines router pairs qwen35.
set -uo pipefail
cd "$(dirname "$0")/.."
export FLA_FLASH_QLA=0
status=0
align() { local name=$1; shift
  rm -rf "align_out/$name"
  verl-moe align "$@" --out "align_out/$name"
  local rc=$?
  # exit 1 = a pair left its tolerances: expected for bf16 against fp64, the report is what is wanted
  [ "$rc" -le 1 ] || status=1
  if [ -f "align_out/$name/report.json" ]; then
    cp "align_out/$name/report.json" "results/$name.json"
    cp "align_out/$name/curves.png" "results/$name.png"
  fi
}
for run in ${RUNS:-engines router pairs qwen35}; do
  case $run in
    # both engines at world 1 (one GPU) on the tiny Qwen3.5-MoE, fp32 and bf16
    engines) align align_tiny_qwen3.5_engines_world1 --preset tiny-qwen3.5-moe --jobs 4 --all-pairs --steps 3 \
      --backends reference,fsdp2:world=1,veomni:world=1:dtype=fp32,veomni:world=1 ;;
    # the router's dtype, engines and megatron-core, on the mid Qwen3-MoE (0.7 B)
    router) align align_mid_qwen3_k20_router --preset mid-qwen3-moe --jobs 4 --steps 20 \
      --backends reference,fsdp2,fsdp2:router=bf16,megatron,megatron:router=bf16 ;;
    # fsdp2 against megatron-core directly, bf16 and fp32
    pairs) align align_mid_qwen3_k20_pairs --preset mid-qwen3-moe --jobs 4 --all-pairs --steps 20 \
      --backends reference,fsdp2,megatron,fsdp2:dtype=fp32,megatron:dtype=fp32 ;;
    # Qwen3.5-MoE (GatedDeltaNet, gated attention, shared expert), 8 backends, K=40, every pair
    qwen35) align align_mid_qwen3.5_k40 --preset mid-qwen3.5-moe --jobs 7 --all-pairs --steps 40 \
      --backends reference,fsdp2,veomni,megatron,fsdp2:router=bf16,megatron:router=bf16,fsdp2:dtype=fp32,megatron:dtype=fp32
      [ -f align_out/align_mid_qwen3.5_k40/logp_hist.png ] && \
        cp align_out/align_mid_qwen3.5_k40/logp_hist.png results/align_mid_qwen3.5_k40_logp_hist.png ;;
    *) echo "unknown run $run (engines router pairs qwen35)"; exit 2 ;;
  esac
done
exit $status
