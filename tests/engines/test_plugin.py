"""Registration with verl: registry precedence, delegation by HF model type, the override
switch, the cpu platform and its process-group fix, and config errors before any model build."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from dist import free_port
from engine_setup import tiny_config
from transformers import Qwen2Config
from verl_moe.engines import plugin
from verl_moe.engines.config import MoeFsdp2EngineConfig, validate_engine_config


def _registry():
    from verl.workers.engine import EngineRegistry

    return EngineRegistry


@pytest.mark.parametrize("role", ["language_model", "value_model"])
def test_our_keys_outrank_verls_without_replacing_them(role):
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead
    from verl_moe.engines.selector import MoeEngineSelector

    verls = FSDPEngineWithLMHead if role == "language_model" else FSDPEngineWithValueHead
    for backend in ("fsdp", "fsdp2"):
        entries = _registry()._engines[role][backend]
        assert entries["cuda"] is verls and entries["npu"] is verls
        assert entries[("cuda", "nvidia")] is MoeEngineSelector
        assert entries[("npu", "huawei")] is MoeEngineSelector
        assert entries[("cpu", "cpu")] is MoeEngineSelector and "cpu" not in entries
        assert _registry().get_engine_cls(role, backend) is MoeEngineSelector  # cpu platform


def test_selection_by_hf_model_type(monkeypatch):
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead
    from verl_moe.engines import selector
    from verl_moe.engines.fsdp2 import MoeFsdp2Engine
    from verl_moe.engines.veomni import MoeVeOmniEngine

    ours = SimpleNamespace(hf_config=tiny_config(), model_type="language_model")
    other = SimpleNamespace(hf_config=Qwen2Config(), model_type="language_model")
    assert selector.select_engine_class(ours, "fsdp2") is MoeFsdp2Engine
    assert selector.select_engine_class(ours, "veomni") is MoeVeOmniEngine
    assert ("language_model", "fsdp2") not in selector.VERL_ENGINES  # cpu platform: verl has no FSDP engine
    with pytest.raises(ValueError, match="'qwen2' has no verl_moe spec"):
        selector.select_engine_class(other, "fsdp2")
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cuda")
    monkeypatch.setattr(selector, "VERL_ENGINES", {})
    selector.record_verl_engines()  # as on a GPU host: verl's look-up before ours is registered
    assert selector.VERL_ENGINES["language_model", "fsdp"] is FSDPEngineWithLMHead
    assert selector.select_engine_class(other, "fsdp") is FSDPEngineWithLMHead
    assert selector.select_engine_class(ours, "fsdp") is MoeFsdp2Engine
    # verl's critic: our engines for our model types, verl's value-head engine for the others
    ours_critic = SimpleNamespace(hf_config=tiny_config(), model_type="value_model")
    other_critic = SimpleNamespace(hf_config=Qwen2Config(), model_type="value_model")
    assert selector.select_engine_class(other_critic, "fsdp") is FSDPEngineWithValueHead
    assert selector.select_engine_class(ours_critic, "fsdp2") is MoeFsdp2Engine
    assert selector.select_engine_class(ours_critic, "veomni") is MoeVeOmniEngine
    with pytest.raises(ValueError, match="serves backends"):
        selector.select_engine_class(ours, "megatron")


_FRESH_PROCESS_CHECK = """
import logging
from verl.utils.device import get_device_name
from verl.workers.engine import EngineRegistry
from verl_moe.engines import plugin
entries = EngineRegistry._engines["language_model"]["fsdp2"]
print("KEYS", sorted(map(str, entries)))
print("DEVICE", get_device_name())
print("HINT", plugin.missing_module_hint(ImportError("x", name="veomni.distributed")))
"""


def test_override_switch_and_no_auto_detection():
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    env["VERL_MOE_OVERRIDE"] = "0"
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _FRESH_PROCESS_CHECK], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(
        line.split(" ", 1) for line in out.stdout.splitlines() if line.split(" ")[0] in {"KEYS", "DEVICE", "HINT"}
    )
    assert lines["KEYS"] == "['cuda', 'npu']"  # verl's own entries only
    assert lines["DEVICE"] == "cuda"  # the cpu platform is only chosen by VERL_PLATFORM=cpu
    assert "pip install 'verl-moe[veomni]'" in lines["HINT"]


def test_cpu_platform_and_process_group_fix(monkeypatch):
    import verl.utils.distributed as verl_distributed
    from verl.plugin.platform import get_platform
    from verl.utils.device import get_nccl_backend, get_torch_device
    from verl_moe.engines.cpu_platform import PlatformCPU

    assert isinstance(get_platform(), PlatformCPU)
    assert get_nccl_backend() == "gloo" and get_torch_device().max_memory_allocated() == 0
    assert get_platform().ray_resource_options(0.5) == {"num_cpus": 0.5}
    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        monkeypatch.setenv(key, value)
    fixed = verl_distributed.initialize_global_process_group_ray
    with pytest.raises(ValueError, match="Duplicate device type cpu"):
        fixed.__wrapped__(backend="cpu:gloo,cpu:gloo")  # the string verl builds on its own
    fixed(timeout_second=60)
    try:
        assert dist.get_backend() == "gloo"
        value = torch.ones(2)
        dist.all_reduce(value)
        assert value.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()


def _model_config(**hf_overrides):
    hf_config = tiny_config()
    for key, value in hf_overrides.items():
        setattr(hf_config, key, value)
    return SimpleNamespace(hf_config=hf_config, lora_rank=0, enable_activation_offload=False)


@pytest.mark.parametrize(
    ("engine_kwargs", "world_size", "message"),
    [
        (dict(strategy="fsdp_turbo"), 2, "unknown strategy 'fsdp_turbo'"),
        (dict(ulysses_sequence_parallel_size=3), 3, "does not divide"),
        # 4 attention heads and 2 kv heads split over 4 ranks; 2 GatedDeltaNet key heads do not
        (dict(ulysses_sequence_parallel_size=4), 4, "does not divide the head counts {'linear_num_key_heads': 2}"),
        (dict(ulysses_sequence_parallel_size=2), 3, "must divide the world size"),
        (dict(fsdp_size=3), 4, "fsdp_size=3"),
        (dict(micro_batch_size_per_gpu=0), 2, "micro_batch_size_per_gpu=0"),
        (dict(param_offload=True, offload_policy=True), 2, "exclusive"),
        (dict(mixed_precision={"param_dtype": "bf16", "compute": "fp32"}), 2, "unknown keys"),
    ],
)
def test_bad_config_raises_before_build(engine_kwargs, world_size, message):
    with pytest.raises(ValueError, match=message):
        validate_engine_config(_model_config(), MoeFsdp2EngineConfig(**engine_kwargs), world_size)


@pytest.mark.parametrize(
    ("engine_kwargs", "world_size", "message"),
    [
        (dict(expert_parallel_size=3), 4, "expert_parallel_size=3 must divide the 4 ranks"),
        (dict(expert_parallel_size=8), 8, "does not divide num_experts=4"),
        # veomni's fsdp_size counts data-parallel ranks: 2 SP groups of 2, shard groups of 1 -> 2 ranks each
        (dict(fsdp_size=1, ulysses_parallel_size=2, expert_parallel_size=4), 4, "must divide the 2 ranks"),
        (dict(fsdp_size=3), 4, "fsdp_size=3 must be -1 or divide 4 ranks"),
        (dict(param_dtype="fp8"), 2, "param_dtype='fp8'"),
        (dict(activation_offload_host_cache_limit_gb=8.0), 2, "activation_offload_host_cache_limit_gb=8.0"),
    ],
)
def test_bad_veomni_config_raises_before_build(engine_kwargs, world_size, message):
    from verl_moe.engines.config import MoeVeOmniEngineConfig

    with pytest.raises(ValueError, match=message):
        validate_engine_config(_model_config(), MoeVeOmniEngineConfig(**engine_kwargs), world_size)


def test_unsupported_model_raises_and_tied_embeddings_pass():
    with pytest.raises(ValueError, match="no verl_moe model spec"):
        validate_engine_config(SimpleNamespace(hf_config=Qwen2Config()), MoeFsdp2EngineConfig(), 1)
    # tied embeddings train on any world size (tests/engines/test_tied_embeddings.py)
    validate_engine_config(_model_config(tie_word_embeddings=True), MoeFsdp2EngineConfig(), 2)


def test_registration_is_idempotent():
    plugin.register_all()  # a second call must not trip verl's duplicate-key assertion
    assert plugin.override_enabled()


@pytest.mark.parametrize(
    ("optimizer", "message"), [(dict(optimizer="muon"), "adamw only"), (dict(lr_scheduler_type="wsd"), "'wsd'")]
)
def test_veomni_engine_refuses_optimizers_it_does_not_build(optimizer, message):
    from verl.workers.config import VeOmniOptimizerConfig
    from verl_moe.engines.config import MoeVeOmniEngineConfig
    from verl_moe.engines.veomni import MoeVeOmniEngine

    with pytest.raises(ValueError, match=message):
        MoeVeOmniEngine(_model_config(), MoeVeOmniEngineConfig(), VeOmniOptimizerConfig(**optimizer), None)
