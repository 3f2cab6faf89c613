"""Gated delta rule (the linear attention of Qwen3.5's GatedDeltaNet layers)."""

from .reference import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref

IMPLS = {
    "torch": "verl_moe.ops.gdn.reference:chunk_gated_delta_rule_ref",
    "fla": "fla.ops.gated_delta_rule:chunk_gated_delta_rule",
}

__all__ = ["IMPLS", "chunk_gated_delta_rule_ref", "recurrent_gated_delta_rule_ref"]
