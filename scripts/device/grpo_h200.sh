#!/usr/bin/env bash
# One device call (~5-7 min): GRPO through verl's own trainer, `python -m verl.trainer.main_ppo`, on
# one H200: recipe/tiny_cpu's layout (our fsdp2 engine, GRPO loss) with platform=gpu_single (our
# rollout shares the GPU with the trainer) on the reduced Qwen3.5-MoE (`scripts/toy_rl.py
# --model-size reduced`: 4 layers, 0.95 B parameters, bf16, the byte-level toy tokenizer's vocabulary
# padded to 320), scripts/toy_rl.py's arith task, STEPS steps of 32 prompts x 8 samples with responses
# of up to 256 tokens. Out: $OUT/grpo.jsonl (verl's per-step metrics), $OUT/grpo_summary.txt
# (generation and training tokens/s per step), $OUT/main_ppo.log (the run's log, last 4 MB).
#   run(command="cd .base && bash scripts/device/grpo_h200.sh", carry=[".base", ".whl", ".whl_rl"])
# (.whl: scripts/device/fetch_wheels.sh, verl and its pure-Python needs; .whl_rl:
# scripts/device/fetch_rl_wheels.sh, Ray and the rest main_ppo imports.)
# CPU dry run of the same command line (tiny model, platform cpu, fp32, short responses, 2 steps):
#   GRPO_CPU=1 OUT=/tmp/grpo_cpu bash scripts/device/grpo_h200.sh
set -o pipefail
if [ "${GRPO_CPU:-0}" = 1 ]; then
  PY=${PY:-.venv/bin/python}
  mkdir -p "${OUT:?set OUT}"
  STEPS=${STEPS:-2} SIZE=tiny PLATFORM=cpu
  SCALE=(data.max_response_length=8 data.train_batch_size=8 actor_rollout_ref.actor.ppo_mini_batch_size=8)
else
  source scripts/device/env.sh
  W=.whl_rl && [ -d "$W" ] || W=../.whl_rl  # beside the checkout when run from a .base copy
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$W"/*.whl || exit 1
  # env.sh puts the checkout on the path without an install, so verl finds no `verl.plugins` entry
  # point: name our plugin module instead (verl imports it in the driver and in every Ray worker)
  export TRITON_CACHE_DIR=/tmp/tc VERL_USE_EXTERNAL_MODULES=verl_moe.engines.plugin
  PY=python3 STEPS=${STEPS:-5} SIZE=reduced PLATFORM=gpu_single
  SCALE=(data.max_response_length=256 data.train_batch_size=32 actor_rollout_ref.actor.ppo_mini_batch_size=32
    actor_rollout_ref.actor.optim.lr=1e-5
    actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16
    actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=bf16 actor_rollout_ref.rollout.dtype=bfloat16)
fi
# SAMPLE=1: every Python process of the run samples its stacks (scripts/device/sampler) into
# $OUT/samples.txt: where the trainer's time goes, by process
if [ "${SAMPLE:-0}" = 1 ]; then
  export PYTHONPATH=$PWD/scripts/device/sampler:$PYTHONPATH VERL_MOE_SAMPLE_DIR=/tmp/samples && rm -rf /tmp/samples
fi
WORK=${GRPO_WORK:-/tmp/grpo} && rm -rf "$WORK"
timeout 90 "$PY" scripts/toy_rl.py data "$WORK" --model-size "$SIZE" --train 256 --val 8 || exit 1
# dynamic micro-batches of up to 16k tokens (the trainer) and 32k (log-probs of the actor and the
# reference) instead of the tiny scale's 8 sequences; no validation, no checkpoints
timeout -k 15 "${RUN_TIMEOUT_S:-380}" "$PY" scripts/toy_rl.py train "$WORK" --platform "$PLATFORM" --steps "$STEPS" \
  "${SCALE[@]}" trainer.val_before_train=false trainer.test_freq=-1 trainer.save_freq=-1 \
  trainer.experiment_name=grpo_$SIZE actor_rollout_ref.actor.use_dynamic_bsz=true \
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
  actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768 \
  actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=32768 \
  > "$WORK.log" 2>&1
RC=$?
echo "main_ppo exit $RC (124: stopped at the time limit)"
tail -c 4000000 "$WORK.log" > "$OUT/main_ppo.log"
[ "$RC" = 0 ] || { grep -E "Error|error:|Traceback" "$WORK.log" | grep -v -i warn | tail -5; tail -20 "$WORK.log" | cut -c1-400; }
# Ray's daemons outlive main_ppo when the timeout stops it (device only: here it would stop every
# Ray cluster of this user)
[ "${GRPO_CPU:-0}" = 1 ] || "$PY" -m ray.scripts.scripts stop --force > /dev/null 2>&1
if [ "${SAMPLE:-0}" = 1 ]; then  # the processes with the most samples first
  for f in $(grep -H -o "samples [0-9]*" /tmp/samples/*.txt | sort -t' ' -k2 -n -r | head -8 | cut -d: -f1); do
    cat "$f"; echo; done | head -c 4000000 > "$OUT/samples.txt"
fi
cp "$WORK/tiny_cpu.jsonl" "$OUT/grpo.jsonl" 2>/dev/null || { echo "no metrics file"; exit 1; }
# generation tokens/s: response tokens / timing_s/gen; training: prompt + response tokens /
# timing_s/update_actor (verl's timing_per_token_ms); step 1 includes the first calls' Triton compiles
"$PY" - "$OUT/grpo.jsonl" <<'EOF' | tee "$OUT/grpo_summary.txt"
import json, sys

rows = [json.loads(line) for line in open(sys.argv[1])]
steps = [(r["step"], r["data"]) for r in rows if "timing_s/gen" in r["data"]]
cols = ("step", "gen_s", "gen_tok/s", "resp_len", "old_lp_s", "ref_s", "update_s", "train_tok/s", "sync_s",
        "step_s", "tok/s/gpu", "score", "probs_diff", "mem_GiB")
print(" ".join(f"{c:>11}" for c in cols))
rates = []
for step, d in steps:
    gen, train = 1000 / d["timing_per_token_ms/gen"], 1000 / d["timing_per_token_ms/update_actor"]
    rates.append((step, gen, train, d["perf/throughput"]))
    vals = (step, d["timing_s/gen"], gen, d["response_length/mean"], d.get("timing_s/old_log_prob", 0),
            d.get("timing_s/ref", 0), d["timing_s/update_actor"], train, d.get("timing_s/update_weights", 0),
            d["timing_s/step"], d["perf/throughput"], d["critic/score/mean"],
            d.get("training/rollout_probs_diff_mean", float("nan")), d.get("actor/perf/max_memory_allocated_gb", 0))
    print(" ".join(f"{v:>11.4g}" if isinstance(v, float) else f"{v:>11}" for v in vals))
later = [r for r in rates if r[0] > 1] or rates
if later:
    n = len(later)
    print(f"steps {later[0][0]}-{later[-1][0]} mean: generation {sum(r[1] for r in later) / n:.0f} tok/s, "
          f"training (update_actor) {sum(r[2] for r in later) / n:.0f} tok/s, "
          f"whole step {sum(r[3] for r in later) / n:.0f} tok/s/GPU")
EOF
