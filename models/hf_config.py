"""Reading transformers configs: the checks and fallbacks both families share."""

from __future__ import annotations


def head_dim(cfg) -> int:
    """transformers' rule: `head_dim` when the config has one, else hidden_size // num_attention_heads."""
    value = getattr(cfg, "head_dim", None)
    return value or cfg.hidden_size // cfg.num_attention_heads


def rope_parameters(cfg) -> dict:
    """The config's rope_parameters; only the default rope type (no scaling) is supported."""
    rope = dict(cfg.rope_parameters or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {rope.get('rope_type')!r} is not supported (only 'default')")
    if "rope_theta" not in rope:
        raise ValueError(f"rope_parameters has no rope_theta: {rope}")
    return rope


def check_common(cfg) -> None:
    """Refuse settings the shared decoder does not implement, rather than ignore them."""
    if cfg.hidden_act != "silu":
        raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only 'silu')")
    if cfg.attention_dropout:
        raise ValueError(f"attention_dropout={cfg.attention_dropout} is not supported (only 0)")
