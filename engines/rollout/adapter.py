"""The per-rank side of our rollout: verl's `BaseRollout` contract, built by verl in every worker
that has a rollout role (`get_rollout_class("verl_moe", "async")`).

Where the model lives: in the worker process, next to the trainer's engine. The replica's
leader rank (rollout rank 0 of a replica; with `tensor_model_parallel_size=1` every rank leads
its own replica) holds the rollout `MoeCausalLM` and its `GenerationEngine`; the other ranks of
a replica only consume the weight stream. The replica's server actor (`server.py`) reaches the
leader through Ray's `__ray_call__` on the worker actor (`call_adapter`), so weights never leave
the process: `update_weights` copies the trainer's full tensors straight into the rollout model.

Memory: `release()` / the server's `sleep` free the rollout model and every decode state (when
`free_cache_engine`, verl's default); `resume(["weights"])` allocates an empty model again and
the next `update_weights` fills it, as verl's hybrid loop does every step; `resume(["kv_cache"])`
(after the trainer offloaded) allocates the decode slots at the size the previous engine ended
with, so the step's requests, arriving one by one, take slots without growing them.
Without `free_cache_engine` the engine, its slots and its captured graphs live across steps.

With `engine_kwargs.verl_moe.speculative_tokens` k > 0 (or verl's `model.mtp.enable_rollout`) a
`SpeculativeEngine` (the model's MTP layer drafts k tokens per round) serves the calls that leave at
most `max_speculative` requests running and `GenerationEngine` the others (`routing.py`); every call here
works on either.
"""

from __future__ import annotations

import gc
import logging
import os
import time
import weakref
from collections.abc import Generator
from typing import Any

import torch
from verl.workers.rollout.base import BaseRollout

from ...models import build, get_spec
from ...models.layers import TopKRouter
from .config import MTP_KEY, OPTIONS_KEY, RolloutOptions, rollout_dtype
from .engine import Completion, GenerationEngine, Request
from .routing import SpeculativeWhereItPays
from .speculative import SpeculativeEngine
from .weights import load_named_tensors

logger = logging.getLogger(__name__)

# replica rank -> the leader adapter of that replica living in this process (Ray calls find it here)
_LEADERS: dict[int, MoeRolloutAdapter] = {}


def call_adapter(actor: Any, replica_rank: int, method: str, *args) -> Any:
    """Run `engine_<method>(*args)` on this process's leader adapter of `replica_rank`; the function
    the server sends through `worker.__ray_call__` (`actor` is the worker instance, unused)."""
    adapter = _LEADERS.get(replica_rank)
    if adapter is None:
        raise ValueError(f"no verl_moe rollout adapter of replica {replica_rank} in this worker process")
    return getattr(adapter, f"engine_{method}")(*args)


def eos_token_ids(model_config: Any) -> set[int]:
    """End-of-sequence ids as vLLM gathers them: the generation config's `eos_token_id` (an int or a
    list) and the tokenizer's; the model config's when neither has one."""
    ids: set[int] = set()
    for source in (getattr(model_config, "generation_config", None), getattr(model_config, "tokenizer", None)):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    if not ids:
        value = getattr(getattr(model_config, "hf_config", None), "eos_token_id", None)
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return {int(i) for i in ids}


class MoeRolloutAdapter(BaseRollout):
    """verl's per-rank rollout object for `rollout.name=verl_moe` (see module docstring).

    Args:
        config: verl RolloutConfig. model_config: verl HFModelConfig (hf_config, tokenizer,
            generation_config). device_mesh: unused (None in verl's CheckpointEngineWorker).
        replica_rank: given by verl's CheckpointEngineWorker; else RANK // replica world size.
    """

    def __init__(self, config, model_config, device_mesh=None, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        c = self.config
        replica_world = c.tensor_model_parallel_size * c.data_parallel_size * c.pipeline_model_parallel_size
        rank = int(os.environ.get("RANK", "0"))
        self.replica_rank = rank // replica_world if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % replica_world
        self.is_leader_rank = self.rollout_rank == 0
        self.options = RolloutOptions.from_rollout_config(c)
        self.dtype = rollout_dtype(c.dtype)
        self.eos_token_ids = eos_token_ids(self.model_config)
        self.global_steps: int | None = None
        self.weights_version = 0  # keys the sampling streams (see update_weights)
        text = get_spec(self.model_config.hf_config.model_type).text_config(self.model_config.hf_config)
        self.vocab_size, self.max_positions = text.vocab_size, text.max_position_embeddings
        k = self.options.speculative_tokens
        if k and not getattr(text, "mtp_num_hidden_layers", 0):  # Qwen3-MoE's config has no such key
            raise ValueError(
                f"{OPTIONS_KEY}.speculative_tokens={k} drafts with the model's MTP layer, and this model has none: "
                f"set {MTP_KEY}.enable=true on a checkpoint with mtp.* tensors, or speculative_tokens=0"
            )
        self._model = None
        self._engine: GenerationEngine | SpeculativeWhereItPays | None = None
        self._slot_sizes: dict = {}  # the last engine's `sizes`, reserved again on wake-up
        self._profiler = None
        self._profile_count = 0
        if self.is_leader_rank:
            if not self.eos_token_ids:
                logger.warning("verl_moe rollout: no eos_token_id in the model's configs; requests stop at length")
            _LEADERS[self.replica_rank] = self

    # ---- verl's BaseRollout contract ---------------------------------------------------------

    async def resume(self, tags: list[str]):
        """tags "weights": allocate the (empty) rollout model; "kv_cache": the decode slots, as large as
        the last engine's before it slept."""
        self.engine_wake_up(tags)

    async def release(self):
        """Free the rollout model and all decode state (when free_cache_engine)."""
        self.engine_sleep()

    async def update_weights(
        self,
        weights: Generator[tuple[str, torch.Tensor], None, None],
        global_steps: int | None = None,
        wire_format: str = "named_tensors",
        **kwargs,
    ):
        """Copy the trainer's tensors into the rollout model (leader) or just drain the stream (other
        ranks: every rank must consume it, the tensors are gathered collectively).

        Raises:
            ValueError: a wire format other than full named tensors, LoRA adapter weights, or weights
                that do not fit the model (see `load_named_tensors`).
        """
        if wire_format != "named_tensors":
            raise ValueError(f"verl_moe rollout takes wire_format='named_tensors', got {wire_format!r}")
        if kwargs.get("peft_config") is not None:
            raise ValueError("verl_moe rollout takes merged weights only (set actor_rollout_ref.model.lora.merge=True)")
        if not self.is_leader_rank:
            for _ in weights:
                pass
            return
        if self._engine is not None and self._engine.num_running:
            raise ValueError("verl_moe rollout: weights updated while requests run; abort or drain them first")
        start = time.perf_counter()
        self._ensure_model()
        allocated = time.perf_counter()
        count = load_named_tensors(self._model, weights)
        self._sync_device()
        loaded = time.perf_counter()
        self.global_steps = global_steps
        # the training step, when verl says it, so a resumed run samples what an uninterrupted one did
        self.weights_version = global_steps if global_steps is not None else self.weights_version + 1
        if self._engine is None:
            self._engine = GenerationEngine(
                self._model,
                self.eos_token_ids,
                seed=self.config.seed,
                max_positions=self.max_positions,
                max_num_seqs=self.config.max_num_seqs,
                sync_every=self.options.sync_every,
                max_prefill_tokens=self.options.max_prefill_tokens,
                device_graphs=False if self.config.enforce_eager else self.options.device_graphs,
            )
            if self.options.speculative_tokens:
                speculative = SpeculativeEngine(
                    self._model,
                    self.eos_token_ids,
                    num_draft_tokens=self.options.speculative_tokens,
                    seed=self.config.seed,
                    max_positions=self.max_positions,
                    max_num_seqs=self.config.max_num_seqs,
                    device_graphs=False if self.config.enforce_eager else self.options.device_graphs,
                )
                self._engine = SpeculativeWhereItPays(speculative, self._engine, self.options.max_speculative)
                logger.info(
                    "verl_moe rollout replica %d: speculative decoding (MTP layer), %d draft tokens per "
                    "round, for calls that leave at most %d requests running",
                    self.replica_rank,
                    speculative.k,
                    self.options.max_speculative,
                )
        # the weights were copied into the model in place: the engine's slots and graphs stay valid
        self._engine.set_weights_version(self.weights_version)
        logger.info(
            "verl_moe rollout replica %d: %d tensors loaded (step %s) in %.3f s (model allocated %.3f s, tensors "
            "received and copied %.3f s, engine %.3f s)",
            self.replica_rank,
            count,
            global_steps,
            time.perf_counter() - start,
            allocated - start,
            loaded - allocated,
            time.perf_counter() - loaded,
        )

    def generate_sequences(self, prompts):
        raise NotImplementedError(
            "verl_moe rollout serves verl's agent loop (async server mode); it has no synchronous generate_sequences"
        )

    # ---- engine side of the server's calls (run in this process through call_adapter) ---------

    def engine_run(self, requests: list[Request], steps: int) -> dict:
        """Admit `requests`, advance all running ones by `steps` tokens (speculative: at least `steps`, or to
        their end). Returns {"completions": [Completion], "running": int, "global_steps": int | None,
        "extra_fields": {request_id: dict}} (speculative: each finished request's draft counts)."""
        if self._engine is None:
            raise ValueError("verl_moe rollout has no weights yet: verl calls update_weights before generating")
        done = self._engine.add(requests) + self._engine.step(steps)
        extra = self._engine.take_request_stats() if isinstance(self._engine, SpeculativeWhereItPays) else {}
        return {
            "completions": done,
            "running": self._engine.num_running,
            "global_steps": self.global_steps,
            "extra_fields": extra,
        }

    def engine_limits(self) -> dict:
        """What the server checks prompts against: {"vocab_size": int, "max_positions": int}."""
        return {"vocab_size": self.vocab_size, "max_positions": self.max_positions}

    def engine_abort(self) -> list[Completion]:
        return [] if self._engine is None else self._engine.abort_all()

    def engine_sleep(self) -> None:
        if not self.is_leader_rank or not self.config.free_cache_engine:
            return
        if self._engine is not None and self._engine.num_running:
            raise ValueError("verl_moe rollout: sleep while requests run; abort or drain them first")
        start = time.perf_counter()
        if self._engine is not None:
            self._slot_sizes = self._engine.sizes
        weights = next(self._model.parameters()) if self._model is not None else None
        held = [weakref.ref(x) for x in (self._engine, weights) if x is not None]
        del weights
        self._engine, self._model = None, None
        # a full collection walks the trainer process's whole heap at every step (docs/rollout.md); it is
        # needed only where a reference cycle still holds the model or the engine (and with them the weights,
        # slots and graph pools)
        if any(ref() is not None for ref in held):
            gc.collect()
        if self._device().type != "cpu":
            from verl.utils.device import get_torch_device

            get_torch_device().empty_cache()
        logger.info("verl_moe rollout replica %d: asleep in %.3f s", self.replica_rank, time.perf_counter() - start)

    def engine_wake_up(self, tags: list[str] | None = None) -> None:
        tags = tags or ["weights", "kv_cache"]
        if not self.is_leader_rank:
            return
        start = time.perf_counter()
        if "weights" in tags:
            self._ensure_model()
        if "kv_cache" in tags and self._engine is not None and self._slot_sizes:
            self._engine.reserve(**self._slot_sizes)
        self._sync_device()
        logger.info(
            "verl_moe rollout replica %d: woke up %s in %.3f s", self.replica_rank, tags, time.perf_counter() - start
        )

    def engine_start_profile(self, **kwargs) -> None:
        """torch.profiler over the engine calls until `engine_stop_profile`, when the rollout profiler
        config enables the torch tool for this replica; otherwise nothing."""
        if self._profiler is not None or not self._profiling_enabled():
            return
        self._profiler = torch.profiler.profile(record_shapes=True, with_stack=False)
        self._profiler.__enter__()

    def engine_stop_profile(self) -> str | None:
        """Stop profiling; returns the chrome trace written under the profiler's save_path (or None)."""
        if self._profiler is None:
            return None
        self._profiler.__exit__(None, None, None)
        folder = self.config.profiler.save_path or "."
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"verl_moe_rollout_replica{self.replica_rank}_{self._profile_count}.json")
        self._profiler.export_chrome_trace(path)
        self._profiler, self._profile_count = None, self._profile_count + 1
        return path

    # ---- internals ---------------------------------------------------------------------------

    def _profiling_enabled(self) -> bool:
        p = self.config.profiler
        if p is None or not p.enable or p.tool != "torch":
            return False
        return p.all_ranks or self.replica_rank in (p.ranks or [])

    def _device(self) -> torch.device:
        from verl.utils.device import get_device_id, get_device_name

        name = get_device_name()
        return torch.device("cpu") if name == "cpu" else torch.device(name, get_device_id())

    def _sync_device(self) -> None:
        """Wait for the device's queued work (so the logged phase times are the device's too)."""
        if self._device().type != "cpu":
            from verl.utils.device import get_torch_device

            get_torch_device().synchronize()

    def _ensure_model(self) -> None:
        """Allocate the rollout model (uninitialised: update_weights fills every parameter)."""
        if self._model is not None:
            return
        # the text decoder of a vision-language config: the rollout generates text from text prompts
        config = self.model_config.hf_config
        model = build(config, dtype=self.dtype, device="meta", ops=self.options.ops, text_only=True)
        model.to_empty(device=self._device())
        if torch.finfo(self.dtype).bits < 32:
            # the trainer keeps every MoE router in its fp32 master dtype (models/fsdp_plan.py): held in the
            # rollout's dtype, the router weights it sends would round, and so would the routing (exact mode
            # then no longer equal)
            for module in model.modules():
                if isinstance(module, TopKRouter):
                    module.float()
        if model.arch.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        self._model = model.eval().requires_grad_(False)
        self._engine = None


__all__ = ["MoeRolloutAdapter", "call_adapter", "eos_token_ids"]
