"""`verl-moe bench exact`'s ablation (`tools/bench/exact.py::_ablation`) on CPU at tiny size, in a
process started with ATEN_CPU_CAPABILITY=default as exact mode requires there: the model all exact matches
the trainer on every token, all fast does not, and each op group is switched alone both ways."""

import json
import os
import subprocess
import sys

from verl_moe.tools.bench.exact import OP_GROUPS

SCRIPT = """
import json, sys, torch
sys.path.insert(0, {models!r})
import verl_moe.models as vm
from tiny_models import randomize_norms, tiny_qwen3_5_moe_text
from verl_moe.tools.bench.rollout import rl_requests
from verl_moe.tools.bench.exact import _ablation
from verl_moe.models.causal_lm import resolve_ops

torch.manual_seed(0)
config = tiny_qwen3_5_moe_text()
model = vm.build(config, dtype=torch.bfloat16)
randomize_norms(model)
exact = resolve_ops(vm.OpsConfig(exact=True), model.arch, torch.bfloat16)
requests = rl_requests(3, config.vocab_size, 0, (1, 8), (2, 4))
for record in _ablation(model.eval(), model.ops, exact, requests, 32, torch.device("cpu")):
    print(json.dumps(record))
"""


def test_ablation_switches_each_op_group_both_ways():
    models = os.path.join(os.path.dirname(__file__), "..", "models")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(models=models)],
        env={**os.environ, "ATEN_CPU_CAPABILITY": "default"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = {(r["op"], r["direction"]): r for r in map(json.loads, done.stdout.splitlines()) if r}
    expected = [("all", "fast"), ("all", "exact")]
    expected += [(op, d) for op in OP_GROUPS for d in ("exact_only", "fast_only")]
    assert list(records) == expected
    assert len({r["tokens"] for r in records.values()}) == 1  # one batch, the same response lengths
    assert records[("all", "exact")]["mismatched_tokens"] == 0
    assert records[("all", "exact")]["max_abs_logprob_diff"] == 0.0
    assert records[("all", "fast")]["mismatched_tokens"] > 0
    # in bf16 on cpu the LM head's product alone (torch's GEMM against the K-ordered one) breaks equality
    assert records[("logits", "fast_only")]["mismatched_tokens"] > 0
