#!/usr/bin/env bash
# benchmarks/grpo.sh in several modes back to back on one machine, so that their step times compare, then one
# table of the steps after the first per mode. MODES (default "fast exact gdn_exact"):
#   fast       fast mode, verl's old-log-prob pass recomputing the old log-probs
#   exact      exact mode with verl's rollout correction in bypass mode (EXACT=1): no old-log-prob pass
#   gdn_exact  fast mode with exact mode's gated delta rule (GDN_EXACT=1): fast mode's mismatch without its
#              largest part
# Every other setting as grpo.sh (STEPS, CPU, FREE_CACHE_ENGINE, PYTHON); each mode writes its own results there.
# About 3 minutes a mode on an H100 (the first compiles and autotunes; the Triton cache serves the others).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
MODES=${MODES:-fast exact gdn_exact}
WROTE=()
for mode in $MODES; do
  case $mode in
    fast) flags=(EXACT=0 GDN_EXACT=0) ;;
    exact) flags=(EXACT=1 GDN_EXACT=0) ;;
    gdn_exact) flags=(EXACT=0 GDN_EXACT=1) ;;
    *) echo "unknown mode '$mode' (fast, exact, gdn_exact)"; exit 2 ;;
  esac
  echo "== $mode"
  out=$(env "${flags[@]}" bash benchmarks/grpo.sh) || { echo "$out"; exit 1; }
  echo "$out" | tail -1
  WROTE+=("$mode=$(echo "$out" | sed -n 's/^wrote //p' | tail -1)")
done
"$PY" - "${WROTE[@]}" <<'PYEOF'
import json
import sys

FIELDS = ("timing_s/step", "timing_s/gen", "timing_s/old_log_prob", "timing_s/ref", "timing_s/update_actor")
DIFF = "rollout/logprob_abs_diff_mean"
print(f"{'mode':10} {'steps':>5} " + " ".join(f"{f.split('/')[1]:>13}" for f in FIELDS) + f" {DIFF:>30}")
for arg in sys.argv[1:]:
    mode, report = arg.split("=", 1)
    rows = [json.loads(line) for line in open(report[: -len(".json")] + ".jsonl")]
    later = [r.get("data", r) for r in rows[1:]] or [rows[0].get("data", rows[0])]  # steps after the first
    def mean(key):
        values = [m[key] for m in later if key in m]
        return f"{sum(values) / len(values):.3f}" if values else "-"
    print(f"{mode:10} {len(later):5} " + " ".join(f"{mean(f):>13}" for f in FIELDS) + f" {mean(DIFF):>30}")
PYEOF
