"""Batched generation with continuous batching over fixed decode slots
(`verl_moe.models.decode.MoeDecoder`).

The engine holds up to `max_num_seqs` slots: the decode state (KV caches, conv and recurrent states)
and each slot's sampling settings, next token, token count and outputs live in tensors on the
model's device, allocated for as many slots and positions as the requests so far needed (grown
geometrically, rarely). New requests are prefilled together (packed forwards of at most
`max_prefill_tokens` tokens) into free slots and sample their first token; a longer prompt takes a
slot with its first chunk, and its next chunks run one per `sync_every` decode steps of the others
(so a long prompt does not stall the running requests), the request decoding once its last chunk is
in. `step(k)` advances the running slots by up to k tokens. A step runs
the slots [0, B) (B a power of two covering the highest running slot) with an `active` mask and
samples, records and detects the end of every sequence on the device; the host reads the slots back
once per `sync_every` steps (one copy), then frees the finished slots and moves the highest running
ones down into free lower slots, so B follows the number running. For a bf16 or fp32 model on cuda the
model step and the sampling after it run as one device graph per B and set of sampling steps in use
(`StepGraphs`; npu opts in with `device_graphs=True`); otherwise the same step runs eagerly.

Sampling streams: every sampled request draws its t-th token at `stream_uniform(stream, t)` of a
stream of its own: its `seed` when it has one, else `stream_seed(seed, weights_version, prompt, key)`
with key = its `sample_key` and how many requests of the same prompt and sample_key this engine
admitted before it. So its tokens depend on the weights, the seed, the weights version and the
request, not on which requests share its batch or arrive before it. Identical requests (GRPO's n
copies of a prompt) get distinct streams by their arrival rank: their outputs as a set are fixed,
which copy gets which one follows arrival unless the caller tells them apart with a sample_key.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ...models import MoeCausalLM
from ...models.decode import MoeDecoder, SlotState
from ...ops import resolve
from .config import OPTIONS_KEY, ROLLOUT_KEY
from .graphs import StepGraphs, graphs_by_default
from .sampling import (
    SETTING_DTYPES,
    SamplingParams,
    SamplingRows,
    sample_rows,
    settings_of,
    stream_seed,
    uses_of,
)

logger = logging.getLogger(__name__)


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
        raise ValueError(
            f"prompt token id {low if low < 0 else high} is outside the model's vocabulary [0, vocab_size={vocab_size})"
        )
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
    prefilled: int | None = None  # prompt tokens in the slot while a long prompt's chunks are pending

    @property
    def decoding(self) -> bool:
        return self.prefilled is None


# Per-slot tensors beside the sampling settings: name -> (dtype, value of an empty slot).
_SLOT_TENSORS = {
    "tokens": (torch.long, 0),  # the token the slot feeds next
    "active": (torch.bool, False),  # running and not finished
    "count": (torch.long, 0),  # tokens generated (the stream index of the next one)
    "stream": (torch.long, 0),
    "min_tokens": (torch.long, 0),
    "max_tokens": (torch.long, 1),
}
_EMPTY_SETTINGS = settings_of([SamplingParams(max_tokens=1, temperature=0.0)])


def _bucket(n: int, limit: int) -> int:
    """The batch size a step over n slots runs at: the next power of two, at most `limit`."""
    return min(limit, 1 << max(0, n - 1).bit_length())


class GenerationEngine:
    """Generate for many requests at once on one model.

    Args:
        model: a local MoeCausalLM (eval mode is not required: nothing here has dropout).
        eos_token_ids: tokens that end a request (unless its `ignore_eos`).
        seed, weights_version: keys of the sampling streams of requests without their own `seed`
            (the rollout seed; the training step whose weights the model holds).
        max_positions: the longest prompt accepted (the model's max_position_embeddings), None: any.
        max_num_seqs: slots at most (requests running at once).
        sync_every: decode steps between two reads of the slots by the host (a finished slot is
            freed at the next read: at most sync_every - 1 idle steps for it).
        max_prefill_tokens: prompt tokens per packed prefill forward (an admission of more runs in
            several; a longer prompt alone, in chunks of this many).
        device_graphs: run the decode step as device graphs (cuda, or npu through torch_npu: not run);
            None: for a bf16 or fp32 model on cuda.
    """

    def __init__(
        self,
        model: MoeCausalLM,
        eos_token_ids: Iterable[int],
        seed: int = 0,
        weights_version: int = 0,
        max_positions: int | None = None,
        max_num_seqs: int = 256,
        sync_every: int = 8,
        device_graphs: bool | None = None,
        max_prefill_tokens: int = 32768,
    ):
        for key, value in (
            (f"{ROLLOUT_KEY}.max_num_seqs", max_num_seqs),
            (f"{OPTIONS_KEY}.sync_every", sync_every),
            (f"{OPTIONS_KEY}.max_prefill_tokens", max_prefill_tokens),
        ):
            if value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        self.max_prefill_tokens = max_prefill_tokens
        self.decoder = MoeDecoder(model)
        self.vocab_size = model.arch.vocab_size
        self.max_positions = max_positions
        self.max_num_seqs, self.sync_every = max_num_seqs, sync_every
        self.device = self.decoder.device
        if device_graphs is None:
            device_graphs = graphs_by_default(self.decoder)
        self.graphs = StepGraphs(self.decoder) if device_graphs else None
        self.draw = model.ops.sampling  # the op that samples rows without filters (the model resolved it)
        self.uniforms = resolve("sampling.uniforms")  # each row's number of its own stream
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.seed, self.weights_version = seed, weights_version
        self._copies: Counter[tuple] = Counter()  # (prompt, sample_key) -> requests admitted so far
        self._slots: list[_Running | None] = []  # what each slot runs (host side)
        self._state: SlotState | None = None
        self._t: dict[str, torch.Tensor] = {}  # per-slot tensors: _SLOT_TENSORS, settings, stops, outputs

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self._slots)

    def generate(self, requests: Sequence[Request], steps_per_call: int = 64) -> list[Completion]:
        """Run `requests` to completion; completions in the order of `requests`."""
        done = {c.request_id: c for c in self.add(requests)}
        while self.num_running:
            done.update((c.request_id, c) for c in self.step(steps_per_call))
        return [done[r.request_id] for r in requests]

    def add(self, requests: Sequence[Request]) -> list[Completion]:
        """Prefill `requests` into free slots, sample their first tokens and let the unfinished ones
        run. Returns the requests that finished on their first token.

        Raises:
            ValueError: a prompt `check_prompt` refuses, a request id already running or given twice,
                or more requests than free slots (max_num_seqs). Nothing is admitted then: the running
                requests go on as before.
        """
        if not requests:
            return []
        self._check(requests)
        slots = self._take_slots(requests)
        new = [_Running(r, self._stream(r)) for r in requests]
        self._write_settings(slots, new)
        for i, r in zip(slots, new):
            self._slots[i] = r
        uses = self._uses()
        C = self.max_prefill_tokens
        for group in self._prefill_groups(requests):
            at = [slots[n] for n in group]
            logits = self.decoder.prefill([list(requests[n].prompt_ids[:C]) for n in group], self._state, at)
            if len(requests[group[0]].prompt_ids) > C:  # a longer prompt is alone: its next chunks join the steps
                self._slots[at[0]].prefilled = C
                continue
            self._start_decoding(logits, at, uses)
        return self._collect(only=slots)

    def _start_decoding(self, logits: torch.Tensor, slots: list[int], uses: dict[str, bool]) -> None:
        """Slots whose prompts are in: sample their first tokens from `logits` and let them run."""
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        self._t["active"][index] = True
        self._sample(logits, index, self._t["active"][index], uses)

    def _prefill_next_chunk(self) -> None:
        """The next chunk of one long prompt still being prefilled (the lowest such slot); its last
        chunk starts the request decoding."""
        i, r = next(((i, r) for i, r in enumerate(self._slots) if r is not None and not r.decoding), (None, None))
        if r is None:
            return
        C, prompt = self.max_prefill_tokens, r.request.prompt_ids
        logits = self.decoder.prefill([list(prompt[r.prefilled : r.prefilled + C])], self._state, [i], [r.prefilled])
        r.prefilled += C
        if r.prefilled >= len(prompt):
            r.prefilled = None
            self._start_decoding(logits, [i], self._uses())

    def _prefill_groups(self, requests: Sequence[Request]) -> list[list[int]]:
        """Consecutive groups of request positions whose prompts together hold at most
        `max_prefill_tokens` tokens (a longer prompt alone, prefilled in chunks of that many), so every
        packed forward stays within that many tokens of activations."""
        groups, tokens = [[]], 0
        for n, r in enumerate(requests):
            if groups[-1] and tokens + len(r.prompt_ids) > self.max_prefill_tokens:
                groups, tokens = groups + [[]], 0
            groups[-1].append(n)
            tokens += len(r.prompt_ids)
        return groups

    def step(self, steps: int = 1) -> list[Completion]:
        """Advance every running sequence by up to `steps` tokens; returns those that finished."""
        finished: list[Completion] = []
        while steps > 0 and self.num_running:
            self._prefill_next_chunk()  # one chunk of a long prompt per sync_every steps of the others
            if not any(r is not None and r.decoding for r in self._slots):
                continue  # only prompts being prefilled: their chunks run back to back
            chunk = min(steps, self.sync_every)
            B = _bucket(1 + max(i for i, r in enumerate(self._slots) if r is not None), len(self._slots))
            t, uses = self._t, self._uses()
            tokens, active = t["tokens"][:B], t["active"][:B]
            sample = functools.partial(self._sample, index=slice(0, B), active=active, uses=uses)
            for _ in range(chunk):
                if self.graphs is not None:  # the model step and the sampling in one graph
                    self.graphs.step(tokens, self._state, active, then=sample, key=tuple(sorted(uses.items())))
                else:
                    sample(self.decoder.step(tokens, self._state, active))
            finished += self._collect()
            self._pack()
            steps -= chunk
        return finished

    @property
    def sizes(self) -> dict[str, int]:
        """What the slots have room for now, as `reserve` takes it (all 0 before the first request)."""
        t = self._t
        return {
            "slots": len(self._slots),
            "positions": self._state.capacity if self._state is not None else 0,
            "outputs": t["out_tokens"].shape[1] if t else 0,
            "stops": t["stops"].shape[1] if t else 0,
        }

    def reserve(self, slots: int, positions: int, outputs: int, stops: int) -> None:
        """Allocate room up front for `slots` slots (at most max_num_seqs) of `positions` positions,
        `outputs` generated tokens and `stops` stop ids each: requests that fit then take slots without
        growing them (each growth reallocates the slots and drops the captured graphs). A new engine
        given an old one's `sizes` starts where the old one ended."""
        if slots > 0:
            self._grow(min(slots, self.max_num_seqs), positions, outputs, stops)

    def set_weights_version(self, weights_version: int) -> None:
        """Key the streams of requests admitted from now on by `weights_version` (the model's weights
        were just replaced in place), as a new engine would: arrival ranks count from zero again.

        Raises:
            ValueError: requests are running (their streams are keyed by the old weights).
        """
        if self.num_running:
            raise ValueError("weights version changed while requests run; abort or drain them first")
        self.weights_version = weights_version
        self._copies.clear()

    def abort_all(self) -> list[Completion]:
        """Stop every running sequence; each returns what it generated so far (finish_reason "abort")."""
        aborted = self._collect(abort=True)
        if self._t:
            self._t["active"].zero_()
        return aborted

    # ---- slots -------------------------------------------------------------------------------

    def _take_slots(self, requests: Sequence[Request]) -> list[int]:
        """The lowest free slots for `requests`, the slots grown (more of them, more positions, longer
        output buffers) when they do not fit."""
        free = [i for i, r in enumerate(self._slots) if r is None]
        running = len(self._slots) - len(free)
        if running + len(requests) > self.max_num_seqs:
            raise ValueError(
                f"{len(requests)} requests do not fit: {running} of max_num_seqs={self.max_num_seqs} slots are running "
                f"({ROLLOUT_KEY}.max_num_seqs)"
            )
        need_slots = running + len(requests) if len(free) < len(requests) else len(self._slots)
        need_len = max(len(r.prompt_ids) + r.params.max_tokens for r in requests)
        need_out = max(r.params.max_tokens for r in requests)
        need_stops = max(len(self._stops(r.params)) for r in requests)
        self._grow(need_slots, need_len, need_out, need_stops)
        free = [i for i, r in enumerate(self._slots) if r is None]
        return free[: len(requests)]

    def _grow(self, slots: int, length: int, out: int, stops: int) -> None:
        """Make room for `slots` slots of `length` positions, `out` outputs and `stops` stop ids each
        (powers of two, so growth is rare); copies what is there."""
        S = len(self._slots)
        cap = self._state.capacity if self._state is not None else None
        T = self._t["out_tokens"].shape[1] if self._t else 0
        M = self._t["stops"].shape[1] if self._t else 0
        if slots <= S and (cap is None or length <= cap) and out <= T and stops <= M and self._state is not None:
            return
        S2 = max(S, _bucket(slots, self.max_num_seqs))
        L2 = max(cap or 0, _bucket(length, 1 << 62))
        T2, M2 = max(T, _bucket(out, 1 << 62)), max(M, _bucket(stops, 1 << 62))
        if self._state is None:
            self._state = self.decoder.allocate(S2, L2)
        else:
            self._state.resize(S2, L2)
        columns = {"out_tokens": (torch.long, 0, T2), "out_logprobs": (torch.float32, 0.0, T2)}
        columns["stops"] = (torch.long, -1, M2)
        empty = dict(_SLOT_TENSORS)
        empty.update({k: (SETTING_DTYPES[k], v[0]) for k, v in _EMPTY_SETTINGS.items()})
        new = {k: torch.full((S2,), f, dtype=d, device=self.device) for k, (d, f) in empty.items()}
        new.update({k: torch.full((S2, n), f, dtype=d, device=self.device) for k, (d, f, n) in columns.items()})
        if "seen" in self._t:
            new["seen"] = torch.zeros(S2, self.vocab_size, dtype=torch.bool, device=self.device)
        for k, t in self._t.items():
            new[k][tuple(slice(0, n) for n in t.shape)] = t
        self._t = new
        if self.graphs is not None:  # they sample into the old tensors
            self.graphs.clear()
        self._slots += [None] * (S2 - S)
        nbytes = self._state.nbytes
        logger.info(
            "verl_moe rollout: %d decode slots x %d positions: KV caches %.3f GiB, linear-attention states %.3f GiB",
            S2,
            L2,
            nbytes["kv"] / 2**30,
            nbytes["linear"] / 2**30,
        )

    def _write_settings(self, slots: list[int], new: list[_Running]) -> None:
        """Each new request's settings, stop ids and a fresh count into its slot (and its prompt into
        the repetition-penalty mask when any request needs one)."""
        t, index = self._t, torch.tensor(slots, dtype=torch.long, device=self.device)
        params = [r.request.params for r in new]
        values = {**settings_of(params), "count": [0] * len(new)}
        values["stream"] = [r.stream or 0 for r in new]
        values["min_tokens"] = [p.min_tokens for p in params]
        values["max_tokens"] = [p.max_tokens for p in params]
        for k, v in values.items():
            t[k][index] = torch.tensor(v, dtype=t[k].dtype, device=self.device)
        stops = torch.full((len(new), t["stops"].shape[1]), -1, dtype=torch.long)
        for n, p in enumerate(params):
            ids = self._stops(p)
            stops[n, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        t["stops"][index] = stops.to(self.device)
        if any(p.repetition_penalty != 1.0 for p in params) and "seen" not in t:
            t["seen"] = torch.zeros(len(self._slots), self.vocab_size, dtype=torch.bool, device=self.device)
            if self.graphs is not None:  # graphs captured without it would not record tokens into it
                self.graphs.clear()
        if "seen" in t:
            seen = torch.zeros(len(new), self.vocab_size, dtype=torch.bool)
            for n, r in enumerate(new):
                seen[n, list(r.request.prompt_ids)] = True
            t["seen"][index] = seen.to(self.device)

    def _stops(self, p: SamplingParams) -> tuple[int, ...]:
        return tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(sorted(self.eos_token_ids)))

    def _pack(self) -> None:
        """Move the running slots above bucket(number running) into free slots below it, so the next
        steps run at the smallest batch size (each moved slot's state is copied once)."""
        running = [i for i, r in enumerate(self._slots) if r is not None]
        B = _bucket(max(1, len(running)), len(self._slots))
        high = [i for i in running if i >= B]
        if not high:
            return
        low = [i for i, r in enumerate(self._slots[:B]) if r is None][: len(high)]
        self._state.move(high, low)
        src, dst = (torch.tensor(x, dtype=torch.long, device=self.device) for x in (high, low))
        for t in self._t.values():
            t[dst] = t[src]
        self._t["active"][src] = False
        for i, j in zip(high, low):
            self._slots[j], self._slots[i] = self._slots[i], None

    # ---- sampling and read-back ------------------------------------------------------------------

    def _uses(self) -> dict[str, bool]:
        """Which sampling steps and checks the running requests need (`uses_of`, plus min_tokens)."""
        params = [r.request.params for r in self._slots if r is not None]
        return {**uses_of(params), "min_tokens": any(p.min_tokens > 0 for p in params)}

    def _sample(self, logits: torch.Tensor, index, active: torch.Tensor, uses: dict[str, bool]) -> None:
        """Sample one token for each row of `index` (a slice or slot ids) and record it in active rows:
        output buffers, count, next token, and the end of the sequence (stop id past min_tokens, or
        max_tokens), all on the device."""
        t = self._t
        count, stops = t["count"][index], t["stops"][index]
        uses = dict(uses)
        if uses.pop("min_tokens"):
            logits = self._mask_early_stops(logits, stops, count < t["min_tokens"][index])
        rows = SamplingRows(
            uniform=self.uniforms(t["stream"][index], count),
            **{k: t[k][index] for k in SETTING_DTYPES},
            **uses,
        )
        tokens, log_probs = sample_rows(logits, rows, t["seen"][index] if "seen" in t else None, self.draw)
        rows_at = torch.arange(len(tokens), device=self.device) if isinstance(index, slice) else index
        at = count.clamp(max=t["out_tokens"].shape[1] - 1)
        for name, value in (("out_tokens", tokens), ("out_logprobs", log_probs)):
            t[name][rows_at, at] = torch.where(active, value, t[name][rows_at, at])
        if "seen" in t:
            t["seen"][rows_at, tokens] |= active
        n = count + 1
        stop = (tokens[:, None] == stops).any(-1) & (n >= t["min_tokens"][index])
        t["count"][index] = count + active
        t["active"][index] = active & ~(stop | (n >= t["max_tokens"][index]))
        t["tokens"][index] = torch.where(active, tokens, t["tokens"][index])  # a graph's capture runs all-inactive

    def _mask_early_stops(self, logits, stops, early) -> torch.Tensor:
        """Rows below their min_tokens cannot sample a token that would end them (vLLM's rule)."""
        N, V = logits.shape
        column = torch.where(stops >= 0, stops, V)  # padding goes to a spare column
        block = torch.zeros(N, V + 1, dtype=torch.bool, device=logits.device)
        block.scatter_(1, column, early[:, None].expand_as(column))
        return logits.masked_fill(block[:, :V], float("-inf"))

    def _collect(self, only: Sequence[int] | None = None, abort: bool = False) -> list[Completion]:
        """Read the slots back (one copy): the running requests among `only` (default all) that
        finished, or all of them when `abort`, as Completions; their slots are freed."""
        candidates = [i for i in (range(len(self._slots)) if only is None else only) if self._slots[i] is not None]
        if not abort:  # a prompt still being prefilled has not started
            candidates = [i for i in candidates if self._slots[i].decoding]
        if not candidates:
            return []
        index = torch.tensor(candidates, dtype=torch.long, device=self.device)
        t = self._t
        state = torch.stack([t["active"][index].long(), t["count"][index]], 1).tolist()
        done = [(i, n) for i, (running, n) in zip(candidates, state) if abort or not running]
        if not done:
            return []
        rows = torch.tensor([i for i, _ in done], dtype=torch.long, device=self.device)
        # one copy of both: token ids are exact in fp64 (< 2**53)
        out = torch.cat([t["out_tokens"][rows].double(), t["out_logprobs"][rows].double()], 1).tolist()
        T = t["out_tokens"].shape[1]
        completions = []
        for (i, n), values in zip(done, out):
            r = self._slots[i]
            tokens = [int(x) for x in values[:n]]
            p = r.request.params
            if abort:
                reason = "abort"
            elif tokens and tokens[-1] in self._stops(p) and n >= p.min_tokens:
                reason = "stop"
            else:
                reason = "length"
            log_probs = values[T : T + n] if p.logprobs else None
            completions.append(Completion(r.request.request_id, tokens, log_probs, reason))
            self._slots[i] = None
        return completions

    # ---- internals ---------------------------------------------------------------------------

    def _check(self, requests: Sequence[Request]) -> None:
        running_ids = {r.request.request_id for r in self._slots if r is not None}
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


__all__ = ["Completion", "GenerationEngine", "Request", "check_prompt"]
