#!/usr/bin/env bash
# Our kernels inside the anchors' own models, one training step of the reduced Qwen3.5-MoE (hidden 2048, 8
# layers, 64 experts top-8, vocabulary 248,320, bf16) on one CUDA GPU, each pair in one process from the
# same weights:
#   veomni:       VeOmni 0.1.12's own model with its default GPU kernels vs `verl_moe` in every slot we serve
#                 (1 x 8192 tokens; 16,384 tokens packed as 16 sequences) -> $OUT/integrations_veomni_L8.json
#   transformers: transformers' Qwen3_5MoeForCausalLM patched (apply_to_qwen3_5_moe) vs unpatched with fla,
#                 and unpatched on its torch GatedDeltaNet (1 x 8192, 1 x 16384) -> $OUT/integrations_transformers_L8.json
# Runs from a checkout without installing it (python -m verl_moe.tools.cli). Needs typer and rich, fla-core
# and liger-kernel for the anchors ('.[bench]'), and VeOmni (pip install --no-deps veomni==0.1.12 blobfile
# tiktoken einops); without VeOmni (or fla / Liger) the rows it cannot run are skipped with the reason.
# RUNS= picks some of: veomni transformers (each fits a 10-minute slot; both compile and autotune on their
# first step). OUT= where the reports go (default results/); PYTHON= the interpreter (default python).
set -uo pipefail
cd "$(dirname "$0")/.."
export FLA_FLASH_QLA=0
OUT=${OUT:-results}
mkdir -p "$OUT"
status=0
for run in ${RUNS:-veomni transformers}; do
  case $run in
    veomni|transformers)
      "${PYTHON:-python}" -m verl_moe.tools.cli bench "$run" --mode fwd_bwd --reps 5 --json "$OUT/integrations_${run}_L8.json" \
        || status=1 ;;
    *) echo "unknown run $run (veomni transformers)"; exit 2 ;;
  esac
done
exit $status
