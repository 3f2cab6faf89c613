"""Batched generation with continuous batching over `verl_moe.models.decode.MoeDecoder`.

New requests are prefilled together (one packed forward), sample their first token, and join
the running batch; `step(k)` advances every running sequence by up to k tokens. A sequence
leaves the batch (its state rows dropped) when it samples an end-of-sequence / stop token or
reaches its `max_tokens`. One engine per rollout replica and weights version, living in the process
that holds the weights (the trainer worker in verl's hybrid mode).

Sampling streams: every sampled request draws its t-th token at `stream_uniform(stream, t)` of a
stream of its own: its `seed` when it has one, else `stream_seed(seed, weights_version, prompt, key)`
with key = its `sample_key` and how many requests of the same prompt and sample_key this engine
admitted before it. So its tokens
depend on the weights, the seed, the weights version and the request, not on which requests share its
batch or arrive before it. Identical requests (GRPO's n copies of a prompt) get distinct streams by
their arrival rank: their outputs as a set are fixed, which copy gets which one follows arrival
unless the caller tells them apart with a sample_key.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ...models import MoeCausalLM
from ...models.decode import DecodeState, MoeDecoder
from .sampling import SamplingParams, sample, stream_seed, stream_uniform


@dataclass(frozen=True)
class Request:
    """request_id: the caller's id; prompt_ids: non-empty token ids; params: its sampling settings;
    sample_key: part of the sampling stream's key (see the module docstring), e.g. a stable id the
    caller gives each copy of a prompt."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    sample_key: str = ""


def check_prompt(prompt_ids: Sequence[int], vocab_size: int, max_positions: int | None = None) -> None:
    """Raises ValueError (one line) for an empty prompt, a token id outside [0, vocab_size), or a
    prompt of more than max_positions tokens (the model's max_position_embeddings; None: no limit)."""
    if len(prompt_ids) == 0:
        raise ValueError("prompt is empty: generation needs at least one prompt token")
    low, high = min(prompt_ids), max(prompt_ids)
    if low < 0 or high >= vocab_size:
        raise ValueError(f"prompt token id {low if low < 0 else high} is outside the vocabulary [0, {vocab_size})")
    if max_positions is not None and len(prompt_ids) > max_positions:
        raise ValueError(
            f"prompt of {len(prompt_ids)} tokens is longer than the model's max_position_embeddings={max_positions}"
        )


@dataclass(frozen=True)
class Completion:
    """A finished (or aborted) request. finish_reason: "stop" (end-of-sequence or stop token),
    "length" (max_tokens) or "abort". log_probs: one per token when the request asked, else None."""

    request_id: str
    token_ids: list[int]
    log_probs: list[float] | None
    finish_reason: str


@dataclass
class _Running:
    request: Request
    stream: int | None  # None: greedy
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)


class GenerationEngine:
    """Generate for many requests at once on one model.

    Args:
        model: a local MoeCausalLM (eval mode is not required: nothing here has dropout).
        eos_token_ids: tokens that end a request (unless its `ignore_eos`).
        seed, weights_version: keys of the sampling streams of requests without their own `seed`
            (the rollout seed; the training step whose weights the model holds).
        max_positions: the longest prompt accepted (the model's max_position_embeddings), None: any.
    """

    def __init__(
        self,
        model: MoeCausalLM,
        eos_token_ids: Iterable[int],
        seed: int = 0,
        weights_version: int = 0,
        max_positions: int | None = None,
    ):
        self.decoder = MoeDecoder(model)
        self.vocab_size = model.arch.vocab_size
        self.max_positions = max_positions
        self.device = model.lm_head.weight.device
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.seed, self.weights_version = seed, weights_version
        self._copies: Counter[tuple] = Counter()  # (prompt, sample_key) -> requests admitted so far
        self._running: list[_Running] = []
        self._state: DecodeState | None = None
        self._last: torch.Tensor | None = None  # [N] the token each running sequence feeds next

    @property
    def num_running(self) -> int:
        return len(self._running)

    def generate(self, requests: Sequence[Request], steps_per_call: int = 64) -> list[Completion]:
        """Run `requests` to completion; completions in the order of `requests`."""
        done = {c.request_id: c for c in self.add(requests)}
        while self._running:
            done.update((c.request_id, c) for c in self.step(steps_per_call))
        return [done[r.request_id] for r in requests]

    def add(self, requests: Sequence[Request]) -> list[Completion]:
        """Prefill `requests`, sample their first tokens and let the unfinished ones join the batch.
        Returns the requests that finished on their first token.

        Raises:
            ValueError: a prompt `check_prompt` refuses, a request id already running or given twice.
                Nothing is admitted then: the running requests go on as before.
        """
        if not requests:
            return []
        self._check(requests)
        capacity = max(len(r.prompt_ids) + r.params.max_tokens for r in requests)
        logits, state = self.decoder.prefill([list(r.prompt_ids) for r in requests], capacity=capacity)
        new = [_Running(r, self._stream(r)) for r in requests]
        finished, keep, tokens = self._sample(new, logits)
        new = [new[i] for i in keep]
        if new:
            state = state.select(keep) if len(keep) < len(requests) else state
            self._running += new
            self._state = state if self._state is None else DecodeState.concat([self._state, state])
            last = tokens[keep]
            self._last = last if self._last is None else torch.cat([self._last, last])
        return finished

    def step(self, steps: int = 1) -> list[Completion]:
        """Advance every running sequence by up to `steps` tokens; returns those that finished."""
        finished: list[Completion] = []
        for _ in range(steps):
            if not self._running:
                break
            logits = self.decoder.step(self._last, self._state)
            done, keep, tokens = self._sample(self._running, logits)
            finished += done
            if len(keep) < len(self._running):
                self._running = [self._running[i] for i in keep]
                self._state = self._state.select(keep) if keep else None
                tokens = tokens[keep]
            self._last = tokens if self._running else None
        return finished

    def abort_all(self) -> list[Completion]:
        """Stop every running sequence; each returns what it generated so far (finish_reason "abort")."""
        aborted = [self._completion(r, "abort") for r in self._running]
        self._running, self._state, self._last = [], None, None
        return aborted

    # ---- internals ---------------------------------------------------------------------------

    def _check(self, requests: Sequence[Request]) -> None:
        running_ids = {r.request.request_id for r in self._running}
        seen: set[str] = set()
        for r in requests:
            if r.request_id in running_ids:
                raise ValueError(f"request {r.request_id!r} is already running")
            if r.request_id in seen:
                raise ValueError(f"request id {r.request_id!r} appears twice in one add call")
            seen.add(r.request_id)
            try:
                check_prompt(r.prompt_ids, self.vocab_size, self.max_positions)
            except ValueError as e:
                raise ValueError(f"request {r.request_id!r}: {e}") from None

    def _stream(self, r: Request) -> int | None:
        if r.params.greedy:
            return None
        if r.params.seed is not None:
            return r.params.seed
        copy = (r.prompt_ids, r.sample_key)
        stream = stream_seed(self.seed, self.weights_version, r.prompt_ids, f"{r.sample_key}/{self._copies[copy]}")
        self._copies[copy] += 1
        return stream

    def _sample(self, running: list[_Running], logits: torch.Tensor):
        """Sample one token per running sequence; returns (finished completions, kept row indices,
        sampled tokens [N])."""
        logits = self._mask_early_stops(running, logits)
        params = [r.request.params for r in running]
        seen = self._seen(running) if any(p.repetition_penalty != 1.0 for p in params) else None
        uniforms = [None if r.stream is None else stream_uniform(r.stream, len(r.tokens)) for r in running]
        tokens, log_probs = sample(logits, params, uniforms, seen)
        finished, keep = [], []
        for i, (r, token, lp) in enumerate(zip(running, tokens.tolist(), log_probs.tolist())):
            r.tokens.append(token)
            r.log_probs.append(lp)
            p = r.request.params
            stops = p.stop_token_ids + (() if p.ignore_eos else tuple(self.eos_token_ids))
            if token in stops and len(r.tokens) >= p.min_tokens:
                finished.append(self._completion(r, "stop"))
            elif len(r.tokens) >= p.max_tokens:
                finished.append(self._completion(r, "length"))
            else:
                keep.append(i)
        return finished, keep, tokens

    def _mask_early_stops(self, running: list[_Running], logits: torch.Tensor) -> torch.Tensor:
        """Rows below their min_tokens cannot sample a token that would end them (vLLM's rule)."""
        rows = [i for i, r in enumerate(running) if len(r.tokens) < r.request.params.min_tokens]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            p = running[i].request.params
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
            ids = [t for t in stops if 0 <= t < logits.shape[-1]]
            if ids:
                logits[i, ids] = float("-inf")
        return logits

    def _seen(self, running: list[_Running]) -> torch.Tensor:
        seen = torch.zeros(len(running), self.vocab_size, dtype=torch.bool, device=self.device)
        for i, r in enumerate(running):
            ids = torch.tensor(list(r.request.prompt_ids) + r.tokens, dtype=torch.long, device=self.device)
            seen[i, ids] = True
        return seen

    @staticmethod
    def _completion(r: _Running, reason: str) -> Completion:
        lps = list(r.log_probs) if r.request.params.logprobs else None
        return Completion(r.request.request_id, list(r.tokens), lps, reason)


__all__ = ["Completion", "GenerationEngine", "Request", "check_prompt"]
