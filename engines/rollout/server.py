"""The rollout server: one async Ray actor per replica that verl's agent loop calls directly
(`LLMServerClient.generate` -> `server.generate.remote(...)`, no HTTP).

It queues requests and drives the replica's engine in calls of `steps_per_call` tokens: each
call admits the queued requests (one packed prefill) into the running batch and advances all of
them, so requests that arrive while others decode join at the next call (continuous batching).
The engine lives in the leader worker process (`adapter.py`); `RayEngineClient` reaches it with
`worker.__ray_call__`, `LocalEngineClient` calls an adapter in this process (tests).

Requests are checked when they arrive (prompt, token ids, lengths, sampling parameters), so a bad
request fails alone, before it reaches the engine. Sampling streams (see `engine.py`): identical
prompts are told apart by their rank of arrival on this replica. With verl's
`rollout.full_determinism` the agent loop's request ids are stable across runs (`det-<priority>`:
the batch position under verl's legacy trainer, `det-0` for all under the v1 trainer, which sets no
priorities) and key the streams too, and requests decode one at a time, so their log-probs, not
only their tokens, do not depend on what else was running.

The control methods are the ones verl's `RolloutReplica` and trainers call on a server
(`wake_up`, `sleep`, `clear_kv_cache`, `release_kv_cache`, `resume_kv_cache`,
`abort_all_requests`, `resume_generation`, `start_profile`, `stop_profile`, plus vLLM's
`set_global_steps`, `wait_for_requests_to_drain`, `abort_request`, `get_rollout_config`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import RolloutConfig
from verl.workers.rollout.replica import TokenOutput

from .config import ROLLOUT_KEY, RolloutOptions
from .engine import Completion, Request, check_prompt
from .sampling import SamplingParams

logger = logging.getLogger(__name__)


class RayEngineClient:
    """Engine calls on the replica's leader worker actor (runs `adapter.call_adapter` there)."""

    def __init__(self, worker, replica_rank: int):
        self.worker, self.replica_rank = worker, replica_rank

    async def call(self, method: str, *args) -> Any:
        from .adapter import call_adapter

        return await self.worker.__ray_call__.remote(call_adapter, self.replica_rank, method, *args)


class LocalEngineClient:
    """Engine calls on an adapter in this process."""

    def __init__(self, adapter):
        self.adapter = adapter

    async def call(self, method: str, *args) -> Any:
        return getattr(self.adapter, f"engine_{method}")(*args)


def _token_output(c: Completion, global_steps: int | None, fields: dict | None = None) -> TokenOutput:
    stop_reason = "aborted" if c.finish_reason == "abort" else "completed"
    extra = {"global_steps": global_steps, **(fields or {})}
    return TokenOutput(token_ids=c.token_ids, log_probs=c.log_probs, stop_reason=stop_reason, extra_fields=extra)


class MoeRolloutServer:
    """Token-in-token-out server of one verl_moe rollout replica.

    Args:
        config: verl RolloutConfig (or its DictConfig): prompt/response lengths, max_model_len,
            max_num_seqs, free_cache_engine, engine_kwargs.verl_moe (see `RolloutOptions`).
        workers: the replica's worker actors; the first holds the engine. Ignored with `engine`.
        replica_rank: this replica's rank (the key of its adapter in the leader process).
        engine: an engine client (default `RayEngineClient(workers[0], replica_rank)`).
    """

    def __init__(self, config, workers: list | None = None, replica_rank: int = 0, engine=None, rollout_mode=None):
        self.config: RolloutConfig = (
            config if isinstance(config, RolloutConfig) else omega_conf_to_dataclass(config, RolloutConfig)
        )
        self.options = RolloutOptions.from_rollout_config(self.config)
        if self.config.enable_rollout_routing_replay:
            key = f"{ROLLOUT_KEY}.enable_rollout_routing_replay"
            raise ValueError(f"verl_moe rollout does not return routed experts: set {key}=false")
        self.replica_rank, self.rollout_mode = replica_rank, rollout_mode
        self.engine = engine if engine is not None else RayEngineClient(workers[0], replica_rank)
        self.max_model_len = self.config.max_model_len or (self.config.prompt_length + self.config.response_length)
        # a lone sequence runs the same operations whatever else arrives; batched ones do not (small
        # batches take other matmul paths, hence other roundings)
        self.max_num_seqs = 1 if self.config.full_determinism else self.config.max_num_seqs
        self._limits: dict | None = None  # the model's vocab_size and max_positions, asked once
        self.global_steps: int | None = None
        self._ids = itertools.count()
        self._queue: list[tuple[Request, asyncio.Future]] = []
        self._running: dict[str, asyncio.Future] = {}
        self._lock = asyncio.Lock()  # one engine call at a time
        self._serving: asyncio.Task | None = None
        self._gate = asyncio.Event()  # closed by abort_all_requests until resume_generation
        self._gate.set()
        self._rejecting = False

    # ---- generation --------------------------------------------------------------------------

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        audio_data: list[Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        priority: int = 0,
        **kwargs,
    ) -> TokenOutput:
        """Generate a continuation of `prompt_ids`; returns verl's TokenOutput (log_probs when
        `sampling_params["logprobs"]`). Without `max_tokens` the budget is vLLM's in verl:
        min(response_length, prompt_length + response_length - len(prompt)), clamped to
        [1, room]; a given `max_tokens` is capped at room, room = min(max_model_len, the model's
        max_position_embeddings) - len(prompt).

        With speculative decoding on, extra_fields also carry the request's draft counts
        (`spec_num_draft_tokens`, `spec_num_accepted_tokens`, `spec_num_verify_steps`).

        Raises:
            ValueError: multimodal input, extra arguments, a prompt `check_prompt` refuses or that
                leaves no room, max_tokens < 1, or sampling parameters the sampler does not implement.
        """
        if any(x is not None for x in (image_data, video_data, audio_data)) or mm_processor_kwargs:
            raise ValueError("verl_moe rollout generates from text token ids only (no image/video/audio input)")
        if kwargs:
            raise ValueError(f"verl_moe rollout: unexpected generate argument(s) {sorted(kwargs)}")
        from verl.utils import normalize_token_ids

        prompt_ids = normalize_token_ids(prompt_ids)
        if self._limits is None:
            self._limits = await self.engine.call("limits")
        check_prompt(prompt_ids, self._limits["vocab_size"], self._limits["max_positions"])
        context = min(self.max_model_len, self._limits["max_positions"])
        room = context - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens leaves no room to generate within {context} tokens: "
                f"{self._context_setting()}"
            )
        params = dict(sampling_params)
        max_tokens = params.pop("max_tokens", None)
        if max_tokens is None:
            max_tokens = params.pop("max_new_tokens", None)
        if max_tokens is None:
            c = self.config
            max_tokens = max(1, min(c.response_length, c.prompt_length + c.response_length - len(prompt_ids)))
        elif int(max_tokens) < 1:
            raise ValueError(f"sampling parameter max_tokens must be >= 1, got {max_tokens}")
        params.setdefault("ignore_eos", self.config.ignore_eos)
        request = Request(
            request_id=f"{request_id}#{next(self._ids)}",
            prompt_ids=tuple(prompt_ids),
            params=SamplingParams.from_request(params, min(int(max_tokens), room)),
            # verl's ids are stable across runs only under full_determinism (else fresh uuids); the
            # replica rank keeps identical prompts on different replicas on different streams
            sample_key=str(request_id) if self.config.full_determinism else f"replica{self.replica_rank}",
        )
        while not self._gate.is_set():
            if self._rejecting:
                return _token_output(Completion(request.request_id, [], None, "abort"), self.global_steps)
            await self._gate.wait()
        future = asyncio.get_running_loop().create_future()
        self._queue.append((request, future))
        if self._serving is None or self._serving.done():
            self._serving = asyncio.create_task(self._serve())
        completion, global_steps, fields = await future
        return _token_output(completion, global_steps, fields)

    def _context_setting(self) -> str:
        """What sets the context a request must fit: the model's max_position_embeddings where that is the
        smaller, else verl's max_model_len, else the prompt and response lengths it defaults to."""
        c, max_positions = self.config, self._limits["max_positions"]
        if max_positions < self.max_model_len:
            return f"the model's max_position_embeddings={max_positions}"
        if c.max_model_len:
            return f"{ROLLOUT_KEY}.max_model_len={c.max_model_len}"
        return (
            f"data.max_prompt_length={c.prompt_length} + data.max_response_length={c.response_length} "
            f"({ROLLOUT_KEY}.max_model_len unset)"
        )

    async def _serve(self) -> None:
        """Drive the engine until no request is queued or running (a wave), then log the wave's
        requests, tokens, wall time and the part of it spent in engine calls (the rest is waiting for
        requests to arrive and the server's own work)."""
        start, wave = time.perf_counter(), {"requests": 0, "tokens": 0, "calls": 0, "engine_s": 0.0}
        await asyncio.sleep(self.options.batch_wait_ms / 1000)  # let a batch gather
        while self._queue or self._running:
            async with self._lock:
                if not self._gate.is_set():
                    break  # abort_all_requests answered everything
                room = max(0, self.max_num_seqs - len(self._running))
                admitted, self._queue = self._queue[:room], self._queue[room:]
                for request, future in admitted:
                    self._running[request.request_id] = future
                try:
                    call_start = time.perf_counter()
                    result = await self.engine.call("run", [r for r, _ in admitted], self.options.steps_per_call)
                    wave["engine_s"] += time.perf_counter() - call_start
                except Exception as exc:
                    await self._fail_running(exc)
                    continue
            self._finish(result["completions"], result["global_steps"], result["extra_fields"])
            wave["requests"] += len(admitted)
            wave["tokens"] += sum(len(c.token_ids) for c in result["completions"])
            wave["calls"] += 1
            await asyncio.sleep(0)  # let control calls (abort, sleep) and new requests in between calls
        seconds = time.perf_counter() - start
        logger.info(
            "verl_moe rollout replica %d: %d requests, %d tokens in %.2f s (%.0f tokens/s, %d engine calls "
            "taking %.2f s)",
            self.replica_rank,
            wave["requests"],
            wave["tokens"],
            seconds,
            wave["tokens"] / seconds,
            wave["calls"],
            wave["engine_s"],
        )

    async def _fail_running(self, exc: Exception) -> None:
        """An engine call failed: its requests (the running ones) get the error rather than hang, the
        engine drops their sequences (so sleep and weight updates work again), the queue goes on."""
        logger.error("verl_moe rollout replica %d: engine call failed: %r", self.replica_rank, exc)
        for future in self._running.values():
            if not future.done():
                future.set_exception(exc)
        self._running.clear()
        try:
            await self.engine.call("abort")
        except Exception:
            logger.exception("verl_moe rollout replica %d: abort after the failure failed too", self.replica_rank)

    def _finish(
        self, completions: list[Completion], global_steps: int | None, fields: dict[str, dict] | None = None
    ) -> None:
        if global_steps is not None:
            self.global_steps = global_steps
        fields = fields or {}
        for c in completions:
            future = self._running.pop(c.request_id, None)
            if future is not None and not future.done():
                future.set_result((c, self.global_steps, fields.get(c.request_id)))

    # ---- control -----------------------------------------------------------------------------

    async def wait_for_requests_to_drain(self) -> None:
        while self._serving is not None and not self._serving.done():
            await asyncio.shield(self._serving)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        async with self._lock:
            await self.engine.call("wake_up", tags or ["weights", "kv_cache"])

    async def sleep(self) -> None:
        """Free the replica's weights and states (after the running requests finish)."""
        await self.wait_for_requests_to_drain()
        async with self._lock:
            await self.engine.call("sleep")

    async def clear_kv_cache(self) -> None:
        """Nothing to clear: there is no prefix cache, and decode states exist only per running request."""

    async def release_kv_cache(self) -> None:
        """Nothing held between requests (see clear_kv_cache); waits for running requests to finish."""
        await self.wait_for_requests_to_drain()

    async def resume_kv_cache(self) -> None:
        """Counterpart of release_kv_cache: nothing to restore."""

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        """Stop every queued and running request (each returns its tokens so far, stop_reason
        "aborted") and hold new ones until `resume_generation` (refuse them with an aborted output
        when `reject_request`)."""
        self._gate.clear()
        self._rejecting = reject_request
        async with self._lock:
            completions = await self.engine.call("abort")
            ids = [c.request_id for c in completions]
            self._finish(completions, None)
            for request, future in self._queue:
                ids.append(request.request_id)
                if not future.done():
                    future.set_result((Completion(request.request_id, [], None, "abort"), self.global_steps, None))
            self._queue.clear()
            for request_id, future in list(self._running.items()):  # requests the engine no longer knew
                if not future.done():
                    future.set_result((Completion(request_id, [], None, "abort"), self.global_steps, None))
            self._running.clear()
        logger.info("verl_moe rollout replica %d: aborted %d requests", self.replica_rank, len(ids))
        return {"aborted_count": len(ids), "request_ids": ids}

    async def resume_generation(self) -> None:
        self._rejecting = False
        self._gate.set()

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        """Single-request abort is not offered (vLLM-only API): says so instead of aborting."""
        return {"aborted": False, "request_id": request_id, "error": "verl_moe rollout aborts all requests only"}

    async def start_profile(self, **kwargs) -> None:
        async with self._lock:
            await self.engine.call("start_profile")

    async def stop_profile(self) -> None:
        async with self._lock:
            path = await self.engine.call("stop_profile")
        if path:
            logger.info("verl_moe rollout replica %d: profile written to %s", self.replica_rank, path)

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    def get_rollout_config(self) -> RolloutConfig:
        return self.config


__all__ = ["LocalEngineClient", "MoeRolloutServer", "RayEngineClient"]
