"""verl_moe's Hydra configs: the engine YAML mirrors its dataclass, and every recipe composes with
verl 0.9.1's `ppo_trainer` into the typed config objects verl's workers build (actor and ref
engines are MoeFsdp2EngineConfig, or MoeVeOmniEngineConfig for the veomni recipes), passing the
checks made before any model is built."""

from __future__ import annotations

import dataclasses
import os

import pytest
import verl_moe.configs
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import open_dict
from verl.utils.config import omega_conf_to_dataclass
from verl_moe.engines.config import (
    MoeFsdp2EngineConfig,
    MoeVeOmniEngineConfig,
    engine_layout,
    validate_actor_config,
)

CONFIG_DIR = os.path.dirname(os.path.abspath(verl_moe.configs.__file__))
RECIPES = sorted(name[: -len(".yaml")] for name in os.listdir(os.path.join(CONFIG_DIR, "recipe")))
USER_SCALE = [name for name in RECIPES if not name.startswith("tiny_cpu")]


def _assert_mirrors(node: dict, cls, where: str) -> None:
    """Same keys as the dataclass's fields (plus Hydra's `_target_`, naming the class), recursively."""
    assert node["_target_"] == f"{cls.__module__}.{cls.__qualname__}" or node["_target_"].endswith(
        f".{cls.__qualname__}"
    ), (where, node["_target_"])
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert set(node) - {"_target_"} == set(fields) - {"_target_"}, (where, set(node) ^ set(fields))
    for name, value in node.items():
        if name == "_target_":
            continue
        default = fields[name].default_factory() if fields[name].default_factory is not dataclasses.MISSING else None
        if isinstance(value, dict) and dataclasses.is_dataclass(default):
            _assert_mirrors(value, type(default), f"{where}.{name}")


@pytest.mark.parametrize(("name", "cls"), [("moe_fsdp2", MoeFsdp2EngineConfig), ("moe_veomni", MoeVeOmniEngineConfig)])
def test_engine_yaml_mirrors_dataclass(name, cls):
    with open(os.path.join(CONFIG_DIR, "engine", f"{name}.yaml")) as f:
        node = yaml.safe_load(f)
    _assert_mirrors(node, cls, f"engine/{name}")
    built = omega_conf_to_dataclass(node)
    assert isinstance(built, cls)
    assert built == cls()  # the YAML holds the dataclass defaults


def _compose(recipe: str, overrides=()):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name=f"recipe/{recipe}", overrides=list(overrides))


def _actor_and_ref(cfg):
    """The ActorConfig objects verl's ActorRolloutRefWorker.init_model builds (ref keys renamed as it does)."""
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    ref_node = cfg.actor_rollout_ref.ref
    with open_dict(ref_node):
        ref_node.ppo_mini_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        ref_node.ppo_micro_batch_size = ref_node.pop("log_prob_micro_batch_size", None)
        ref_node.ppo_micro_batch_size_per_gpu = ref_node.pop("log_prob_micro_batch_size_per_gpu", None)
        ref_node.use_dynamic_bsz = ref_node.pop("log_prob_use_dynamic_bsz", False)
        ref_node.ppo_max_token_len_per_gpu = ref_node.pop("log_prob_max_token_len_per_gpu", None)
    return actor, omega_conf_to_dataclass(ref_node)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_builds_engine_configs(recipe):
    cfg = _compose(recipe)
    actor, ref = _actor_and_ref(cfg)
    cls, strategy = (MoeVeOmniEngineConfig, "veomni") if "veomni" in recipe else (MoeFsdp2EngineConfig, "fsdp2")
    assert isinstance(actor.engine, cls) and actor.engine.strategy == strategy
    assert ref.engine.forward_only and ref.engine.strategy == strategy
    validate_actor_config(actor, cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node)
    if recipe in USER_SCALE:
        assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (2048, 20480)
        assert (cfg.data.train_batch_size, cfg.data.gen_batch_size) == (512, 1536)
        assert actor.engine.param_offload and actor.engine.optimizer_offload and actor.engine.fsdp_size == -1
        assert engine_layout(actor.engine).sequence_parallel_size == 8
        assert engine_layout(ref.engine).sequence_parallel_size == 8
        assert engine_layout(actor.engine).expert_parallel_size == (8 if "veomni" in recipe else 1)
        assert cfg.trainer.device == ("npu" if recipe.endswith("_npu") else "cuda")
        (loss,) = [part for part in recipe.split("_") if part in ("grpo", "gspo", "dapo")]
        assert actor.policy_loss.loss_mode == ("gspo" if loss == "gspo" else "vanilla")
        assert actor.use_kl_loss == (loss == "grpo")
        assert cfg.algorithm.filter_groups.enable == (loss == "dapo")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64"], "larger than the mini-batch"),
        (["actor_rollout_ref.actor.strategy=fsdp_turbo"], "unknown strategy 'fsdp_turbo'"),
        (["actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=3"], "must divide the number of ranks"),
    ],
)
def test_bad_recipe_overrides_raise_before_build(overrides, message):
    cfg = _compose("tiny_cpu", overrides)
    actor, _ = _actor_and_ref(cfg)
    with pytest.raises(ValueError, match=message):
        validate_actor_config(actor, cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node)


# recipe -> its `determinism` option (docs/reproducibility.md): what makes two runs log the same metrics
CPU_DETERMINISM = {
    "tiny_cpu": "full",
    "tiny_cpu_veomni": "full",
    "tiny_cpu_ppo": "full",
    "tiny_cpu_exact": "ordered",
    "tiny_cpu_vllm": "none",
}


@pytest.mark.parametrize("recipe", sorted(CPU_DETERMINISM))
def test_cpu_recipes_repeat_as_written(recipe):
    """The CPU recipes set the switches that make runs repeat bitwise (tests/engines/test_rollout_repeat.py
    runs them); `determinism=none` on the command line takes them back out."""
    level = CPU_DETERMINISM[recipe]
    for cfg, expected in ((_compose(recipe), level), (_compose(recipe, ["determinism=none"]), "none")):
        sampler = cfg.trainer.v1.sampler
        ordered = expected != "none"
        assert sampler.custom_sampler.path == ("pkg://verl_moe.engines.rollout.content_order" if ordered else None)
        assert sampler.custom_sampler.name == ("ContentOrderedReplayBuffer" if ordered else None)
        assert sampler.sampler_kwargs.get("poll_interval") == (0.2 if ordered else None)
        assert cfg.actor_rollout_ref.rollout.full_determinism == (expected == "full")
