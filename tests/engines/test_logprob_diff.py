"""`rollout/logprob_abs_diff_{mean,max}` beside verl's rollout-vs-trainer measure: the numbers against a plain
loop over the response tokens, and verl's own `calculate_debug_metrics` (wrapped by the plugin) returning them
with its own keys untouched. The case that motivates it: log-probs that differ by a lot where every
probability is small barely move verl's probability-space measure."""

from __future__ import annotations

import math

import torch
from verl import DataProto
from verl.utils.debug import metrics
from verl_moe.engines.rollout.logprob_diff import logprob_abs_diff


def _batch(rollout: torch.Tensor, actor: torch.Tensor, mask: torch.Tensor) -> DataProto:
    responses = torch.zeros_like(rollout, dtype=torch.long)
    return DataProto.from_dict(
        {"rollout_log_probs": rollout, "old_log_probs": actor, "response_mask": mask, "responses": responses}
    )


def test_values_and_verl_metrics():
    gen = torch.Generator().manual_seed(0)
    actor = -8.0 - torch.rand(4, 6, generator=gen)  # a spread-out distribution: probabilities ~e^-8
    rollout = actor + torch.randn(4, 6, generator=gen)  # wrong by ~1 nat per token
    mask = torch.ones(4, 6)
    mask[1, 3:] = 0
    mask[3, 1:] = 0
    diffs = [abs(a - r) for a, r, m in zip(actor.flatten().tolist(), rollout.flatten().tolist(), mask.flatten())]
    diffs = [d for d, m in zip(diffs, mask.flatten().tolist()) if m]
    data = _batch(rollout, actor, mask)

    ours = logprob_abs_diff(data)
    assert math.isclose(ours["rollout/logprob_abs_diff_mean"], sum(diffs) / len(diffs), rel_tol=1e-12)
    assert ours["rollout/logprob_abs_diff_max"] == max(diffs)

    import verl_moe.engines.plugin  # noqa: F401 - installs the wrapper (idempotent)

    logged = metrics.calculate_debug_metrics(data)
    assert logged["rollout/logprob_abs_diff_max"] == ours["rollout/logprob_abs_diff_max"]
    assert logged["training/rollout_probs_diff_valid"] == 1
    # verl's probability-space measure hardly sees a ~1 nat error at these probabilities
    assert logged["training/rollout_probs_diff_max"] < 1e-2 < ours["rollout/logprob_abs_diff_mean"]
    assert logprob_abs_diff(_batch(rollout, actor, torch.zeros(4, 6))) == {}
