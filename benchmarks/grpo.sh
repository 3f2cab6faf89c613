#!/usr/bin/env bash
# GRPO through verl's own trainer (`python -m verl.trainer.main_ppo`, via scripts/toy_rl.py) on one CUDA GPU:
# recipe/tiny_cpu's layout (our fsdp2 engine, GRPO loss) with platform=gpu_single (our rollout shares the GPU
# with the trainer), on the reduced Qwen3.5-MoE with 4 layers (`scripts/toy_rl.py --model-size reduced`:
# 0.95 B parameters, the toy byte-level vocabulary padded to 320), the arith task, STEPS steps (default 3) of
# 32 prompts x 8 samples with responses of up to 256 tokens. Writes verl's per-step metrics to
# results/rollout_grpo_reduced_L4.jsonl and the record that names them (argv, versions, device, code) to
# results/rollout_grpo_reduced_L4.json; the run's log to $OUT/main_ppo.log. About 3 minutes for 3 steps on an
# H200 (step 1 compiles and autotunes). Needs `pip install .`.
#   CPU=1 bash benchmarks/grpo.sh   the same command line on CPU (tiny model, fp32, short responses, 2
#                                   steps), results in $OUT instead of results/
#   FREE_CACHE_ENGINE=true          verl's default: the rollout frees its model, slots and device graphs at
#                                   every sleep and builds them again each step (results named *_free_cache);
#                                   without it they stay resident across steps (model + slots: ~3 GiB here)
#   SAMPLE=1                        every Python process of the run samples its stacks into $OUT/samples.txt
#                                   (benchmarks/sampler): where the trainer's time goes, by process
#   EXACT=1                         exact mode (docs/exact.md) for actor, reference and rollout, with verl's
#                                   rollout correction in bypass mode: the rollout's log-probs are the old
#                                   log-probs, no old-log-prob pass (results named *_exact); on CPU the run
#                                   also needs ATEN_CPU_CAPABILITY=default, which the script then sets
#   GDN_EXACT=1                     fast mode with exact mode's gated delta rule in actor, reference and
#                                   rollout (`ops.gdn=exact`, docs/exact.md; results named *_gdn_exact)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-grpo_out} && mkdir -p "$OUT"
PY=${PYTHON:-python}
if [ "${CPU:-0}" = 1 ]; then
  STEPS=${STEPS:-2} SIZE=tiny PLATFORM=cpu RESULTS=$OUT
  SCALE=(data.max_response_length=8 data.train_batch_size=8 actor_rollout_ref.actor.ppo_mini_batch_size=8)
else
  STEPS=${STEPS:-3} SIZE=reduced PLATFORM=gpu_single RESULTS=results
  SCALE=(data.max_response_length=256 data.train_batch_size=32 actor_rollout_ref.actor.ppo_mini_batch_size=32
    actor_rollout_ref.actor.optim.lr=1e-5
    actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16
    actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=bf16 actor_rollout_ref.rollout.dtype=bfloat16)
fi
FREE=${FREE_CACHE_ENGINE:-false}
SCALE+=(actor_rollout_ref.rollout.free_cache_engine=$FREE)
if [ "${EXACT:-0}" = 1 ]; then
  [ "$PLATFORM" = cpu ] && export ATEN_CPU_CAPABILITY=default
  SCALE+=(actor_rollout_ref.actor.fsdp_config.ops.exact=true actor_rollout_ref.ref.fsdp_config.ops.exact=true
    +actor_rollout_ref.rollout.engine_kwargs.verl_moe.ops.exact=true actor_rollout_ref.rollout.calculate_log_probs=true
    algorithm.rollout_correction.bypass_mode=true)
fi
if [ "${GDN_EXACT:-0}" = 1 ]; then
  SCALE+=(actor_rollout_ref.actor.fsdp_config.ops.gdn=exact actor_rollout_ref.ref.fsdp_config.ops.gdn=exact
    +actor_rollout_ref.rollout.engine_kwargs.verl_moe.ops.gdn=exact)
fi
if [ "${SAMPLE:-0}" = 1 ]; then
  export PYTHONPATH=$PWD/benchmarks/sampler${PYTHONPATH:+:$PYTHONPATH} VERL_MOE_SAMPLE_DIR=$OUT/samples
  rm -rf "$OUT/samples"
fi
WORK=${GRPO_WORK:-/tmp/grpo} && rm -rf "$WORK"
SETUP=(scripts/toy_rl.py data "$WORK" --model-size "$SIZE" --train 256 --val 8)
# dynamic micro-batches of up to 16k tokens (the update) and 32k (log-probs of the actor and the reference)
# instead of the tiny scale's 8 sequences; no validation, no checkpoints; determinism=ordered instead of the
# CPU recipe's full (which decodes one request at a time): our content-ordered replay buffer, looking for a
# full batch every 0.1 s (verl's sync buffer every 2 s, so a generation counted in steps of 2 s)
TRAIN=(scripts/toy_rl.py train "$WORK" --platform "$PLATFORM" --steps "$STEPS" "${SCALE[@]}"
  trainer.val_before_train=false trainer.test_freq=-1 trainer.save_freq=-1 trainer.experiment_name=grpo_$SIZE
  determinism=ordered trainer.v1.sampler.sampler_kwargs.poll_interval=0.1
  actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384
  actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768
  actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=32768)
"$PY" "${SETUP[@]}" || exit 1
"$PY" "${TRAIN[@]}" > "$OUT/main_ppo.log" 2>&1
RC=$?
if [ "$RC" != 0 ]; then
  echo "main_ppo exited with $RC; the last lines of $OUT/main_ppo.log:"; tail -20 "$OUT/main_ppo.log" | cut -c1-400
  exit 1
fi
if [ "${SAMPLE:-0}" = 1 ]; then  # the processes with the most samples first
  for f in $(grep -H -o "samples [0-9]*" "$OUT"/samples/*.txt | sort -t' ' -k2 -n -r | head -8 | cut -d: -f1); do
    cat "$f"; echo; done > "$OUT/samples.txt"
fi
NAME=rollout_grpo_${SIZE}_L4 && [ "$SIZE" = tiny ] && NAME=rollout_grpo_tiny
[ "$FREE" = true ] && NAME=${NAME}_free_cache
[ "${EXACT:-0}" = 1 ] && NAME=${NAME}_exact
[ "${GDN_EXACT:-0}" = 1 ] && NAME=${NAME}_gdn_exact
cp "$WORK/tiny_cpu.jsonl" "$RESULTS/$NAME.jsonl" || { echo "no metrics file $WORK/tiny_cpu.jsonl"; exit 1; }
# the record scripts/benchmarks_md.py reads: what ran, where, on which code
"$PY" - "$RESULTS/$NAME.json" "$NAME.jsonl" "${#SETUP[@]}" "${SETUP[@]}" "${TRAIN[@]}" <<'PYEOF'
import importlib.metadata
import json
import sys

from verl_moe.tools.provenance import environment

path, metrics, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
argv = sys.argv[4:]
record = {"schema": 1, "tool": "main_ppo", "setup_argv": argv[:n], "argv": argv[n:], **environment()}
record["versions"]["ray"] = importlib.metadata.version("ray")
record["metrics"] = metrics
with open(path, "w") as f:
    json.dump(record, f, indent=2)
print(f"wrote {path}")
PYEOF
