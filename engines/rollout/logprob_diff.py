"""`rollout/logprob_abs_diff_{mean,max}`: |old_log_prob - rollout_log_prob| over response tokens, logged
beside verl's `training/rollout_probs_diff_*` for any rollout (ours, vLLM).

verl's measure compares probabilities (the exp of both log-probs). On a model whose next-token distribution
is spread out every probability is small, so a rollout holding wrong weights moves them little: a vLLM whose
experts missed the update showed `rollout_probs_diff_max` 1.8e-4 and a Pearson correlation of 0.998, while
its mean |Δ log-prob| was 0.81. In log-prob space the same weights give ~1e-6 (fp32 on both sides) and a
bf16 rollout against an fp32 trainer ~1e-2; a rollout that missed an update sits orders of magnitude above.

verl computes its measure in the trainer process with `verl.utils.debug.metrics.calculate_debug_metrics`
(ray_trainer imports it when called, the v1 trainer at its own import, which comes after the plugins run);
`install` wraps that function so its result carries ours too. Upstream this is two lines in that function.
"""

from __future__ import annotations

import functools

import torch


def logprob_abs_diff(data) -> dict[str, float]:
    """{"rollout/logprob_abs_diff_mean": ..., "..._max": ...} over the response tokens of a verl batch
    holding `rollout_log_probs` and `old_log_probs` (the mask as verl's measure takes it); {} without
    response tokens."""
    rollout, actor = data.batch["rollout_log_probs"], data.batch["old_log_probs"]
    if "response_mask" in data.batch.keys():
        mask = data.batch["response_mask"]
    else:
        mask = data.batch["attention_mask"][:, -rollout.shape[-1] :]
    diff = (actor.double() - rollout.double()).abs()[mask.bool()]
    if diff.numel() == 0:
        return {}
    return {"rollout/logprob_abs_diff_mean": diff.mean().item(), "rollout/logprob_abs_diff_max": diff.max().item()}


def install() -> None:
    """Wrap verl's `calculate_debug_metrics` (once) so its metrics include `logprob_abs_diff`."""
    from verl.utils.debug import metrics

    original = metrics.calculate_debug_metrics
    if getattr(original, "_verl_moe", False):
        return

    @functools.wraps(original)
    def calculate_debug_metrics(data) -> dict:
        out = original(data)
        with torch.no_grad():
            out.update(logprob_abs_diff(data))
        return out

    calculate_debug_metrics._verl_moe = True
    metrics.calculate_debug_metrics = calculate_debug_metrics


__all__ = ["install", "logprob_abs_diff"]
