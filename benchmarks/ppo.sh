#!/usr/bin/env bash
# PPO with a critic (GAE) through verl's own trainer (`python -m verl.trainer.main_ppo`, via scripts/toy_rl.py) on
# one CUDA GPU: recipe/tiny_cpu_ppo's layout (our fsdp2 engine for the actor and for the critic, the critic the
# actor's model spec with a value head, started from the actor's checkpoint) with platform=gpu_single (our
# rollout shares the GPU with both trainers), on the reduced Qwen3.5-MoE with 4 layers (`scripts/toy_rl.py
# --model-size reduced`: 0.95 B parameters), the arith task, STEPS steps (default 3) of 32 prompts x 8 samples
# with responses of up to 256 tokens, bf16 compute over fp32 master weights for actor and critic. Writes verl's
# per-step metrics (actor/*, critic/vf_loss, critic/values/*, timing_s/update_critic, ...) to
# $OUT/ppo_reduced_L4.jsonl, the record that names them (argv, versions, device, code) to $OUT/ppo_reduced_L4.json
# and the run's log to $OUT/main_ppo.log. Needs `pip install .`.
#   CPU=1 bash benchmarks/ppo.sh   the same command line on CPU (tiny model, fp32, short responses, 2 steps)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-ppo_out} && mkdir -p "$OUT"
PY=${PYTHON:-python}
if [ "${CPU:-0}" = 1 ]; then
  STEPS=${STEPS:-2} SIZE=tiny PLATFORM=cpu
  SCALE=(data.max_response_length=8 data.train_batch_size=8 actor_rollout_ref.actor.ppo_mini_batch_size=8)
else
  STEPS=${STEPS:-3} SIZE=reduced PLATFORM=gpu_single
  SCALE=(data.max_response_length=256 data.train_batch_size=32 actor_rollout_ref.actor.ppo_mini_batch_size=32
    actor_rollout_ref.actor.optim.lr=1e-5 critic.optim.lr=1e-5
    actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16
    critic.fsdp.mixed_precision.param_dtype=bf16 actor_rollout_ref.rollout.dtype=bfloat16)
fi
WORK=${PPO_WORK:-/tmp/ppo} && rm -rf "$WORK"
SETUP=(scripts/toy_rl.py data "$WORK" --model-size "$SIZE" --train 256 --val 8)
# dynamic micro-batches of up to 16k tokens for the updates (the critic's inherits the actor's switch) and 32k
# for the forward passes (old log-probs, values); no validation, no checkpoints; determinism=ordered instead of
# the CPU recipe's full, which decodes one request at a time
TRAIN=(scripts/toy_rl.py train "$WORK" --recipe tiny_cpu_ppo --platform "$PLATFORM" --steps "$STEPS" "${SCALE[@]}"
  determinism=ordered
  trainer.val_before_train=false trainer.test_freq=-1 trainer.save_freq=-1 trainer.experiment_name=ppo_$SIZE
  actor_rollout_ref.rollout.free_cache_engine=false
  actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384
  actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768
  critic.ppo_max_token_len_per_gpu=16384 critic.forward_max_token_len_per_gpu=32768)
"$PY" "${SETUP[@]}" || exit 1
"$PY" "${TRAIN[@]}" > "$OUT/main_ppo.log" 2>&1
RC=$?
if [ "$RC" != 0 ]; then
  echo "main_ppo exited with $RC; the last lines of $OUT/main_ppo.log:"; tail -20 "$OUT/main_ppo.log" | cut -c1-400
  exit 1
fi
NAME=ppo_${SIZE}_L4 && [ "$SIZE" = tiny ] && NAME=ppo_tiny
cp "$WORK/tiny_cpu_ppo.jsonl" "$OUT/$NAME.jsonl" || { echo "no metrics file $WORK/tiny_cpu_ppo.jsonl"; exit 1; }
"$PY" - "$OUT/$NAME.json" "$NAME.jsonl" "${#SETUP[@]}" "${SETUP[@]}" "${TRAIN[@]}" <<'PYEOF'
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
# one line per step: the critic's loss and values beside the reward
"$PY" - "$OUT/$NAME.jsonl" <<'PYEOF'
import json
import sys

for line in open(sys.argv[1]):
    row = json.loads(line)
    d = row["data"]
    keys = ("critic/score/mean", "critic/vf_loss", "critic/values/mean", "actor/pg_loss", "timing_s/step")
    print(f"step {row['step']}: " + "  ".join(f"{k}={d[k]:.4g}" for k in keys if k in d))
PYEOF
