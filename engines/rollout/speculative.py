"""Speculative decoding with Qwen3.5's MTP layer: a decoding path beside `GenerationEngine`.

Each round, for every running request (slot), batched over the slots up to the highest running one:

1. draft: the MTP layer (`models/mtp_decode.py::MtpDrafter`, its own KV cache) first catches up on the
   positions the main model consumed since the last round (main hidden state at s, token s+1: up to k + 1
   per slot; a prompt's are consumed when the request is admitted, but its last), whose last output,
   through the shared lm_head, drafts d_1; its output at the draft's position and d_1's embedding
   draft d_2, and so on up to k tokens (fewer near max_tokens). Draft tokens are drawn from the MTP
   layer's distribution q at the request's temperature (argmax for greedy requests), each draft step for
   all requests at once on the device (`MtpDrafter.step`, nothing read back): q = softmax(logits / T) in
   fp32 and the token by inverse CDF (`ops.sampling.inverse_cdf`) at one of the request's uniforms;
2. verify: one pass of the main model over K + 1 positions of every slot (the token sampled last, then the
   drafts, padded to K with zeros; `MoeDecoder.verify`: one-token steps' kernels over several positions, the shapes
   fixed by the slot count and K, nothing read back) gives the target distributions p_0 .. p_k and leaves
   the slots' GatedDeltaNet states as they were;
3. accept (`accept_drafts` for sampled requests, `accept_greedy` for greedy ones, both over every slot on
   the device, each slot taking its own): d_i is kept when
   u_i q(d_i) < p(d_i), with probability min(1, p(d_i) / q(d_i)); j, the number of leading kept drafts
   (at most the request's k); the round's last token is drawn from normalize(max(0, p_j - q_{j+1})), q
   taken as 0 at j = k, which gives the bonus token from p_k (p_j itself when the residual sums to 0). So
   every emitted token is distributed exactly as the target's next token (Leviathan et al. 2023, Chen et
   al. 2023). A greedy request keeps a draft when it equals the target's argmax and emits the target's
   argmax otherwise (`accept_greedy`): the target's greedy tokens. The round reads its (j, token) pairs,
   drafts and the emitted tokens' log-probs (the target's) to the host once, after the commit;
4. commit (`MoeDecoder.commit`, on the device): each slot's GatedDeltaNet conv and recurrent states step
   through its j + 1 kept positions again from the inputs the verification recorded, and its length grows
   by j + 1 (the attention caches hold the verified positions already; those past a slot's length are
   never read), so the state holds the accepted tokens only.

The round is one device function of per-slot buffers (`_SlotInputs`: the control rows the host writes each
round, the requests' sampling keys, the pending positions; `_round_on_device`) with shapes fixed by the slot
bucket and k, so on cuda (bf16 / fp32, unless `device_graphs=False`) it is captured once per bucket as a
device graph (`graphs.DeviceGraphs`) and replayed: a round costs one small copy to the device, one replay
and one read.

Every random number of a request comes from its own counter-based stream (`ops.sampling.uniforms`,
resolved as the op `sampling.uniforms`: fp64 in [0, 1), computed on the device), keyed by its `seed` or,
without one, by the stream key `GenerationEngine` gives it (`stream_seed`): number 0 draws its first token,
and each round takes the next 2k + 1 numbers (k engine-wide: k draft draws, k acceptance numbers, one for
the last token) whatever its outcome, so the same request gives the same tokens, alone or batched. The log-prob of each
emitted token is the target's, log_softmax(logits / temperature) in fp32 (temperature 1 for greedy
requests), as the engine returns them. Sampling settings beyond temperature (top-k, top-p, min-p,
repetition penalty, min_tokens) are refused: the rule would need their processed q and p.

The rollout (`adapter.py`, `engine_kwargs.verl_moe.speculative_tokens`) drives it as it drives
`GenerationEngine`: `add`, `step(steps)`, `num_running`, `sizes` / `reserve`, `set_weights_version`,
`abort_all`; `take_request_stats` gives each finished request's draft counts under the names verl's trainer
reads (`spec_num_draft_tokens`, `spec_num_accepted_tokens`, `spec_num_verify_steps`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ...models import MoeCausalLM
from ...models.decode import MoeDecoder, SlotState
from ...models.mtp_decode import MtpCache, MtpDrafter
from ...ops import resolve
from ...ops.device import to_device
from ...ops.sampling import inverse_cdf
from .acceptance import accept_drafts, accept_greedy
from .config import ROLLOUT_KEY
from .engine import Completion, Request, check_prompt
from .graphs import DeviceGraphs, graphs_by_default
from .sampling import SamplingParams, stream_seed


@dataclass
class _Seq:
    request: Request
    slot: int
    stream: int | None  # the request's key of the uniforms; None: greedy
    draws: int = 0  # uniforms of its stream used so far
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finish: str | None = None
    # over the request's rounds with drafts: draft tokens proposed, kept, and those rounds
    drafted: int = 0
    accepted: int = 0
    verified: int = 0


@dataclass
class _SlotInputs:
    """What a round reads and carries over per slot, on the device, in slot order: a round is a function of
    these, the slots' states and the MTP cache only (fixed shapes for a slot count and k)."""

    control: torch.Tensor  # [3, S] int64, written by the host each round: drafts k, active (0/1), draws used
    streams: torch.Tensor  # [S] int64, the request's uniforms key (0 for a greedy request)
    temps: torch.Tensor  # [S] fp32, its temperature (1 for a greedy request)
    greedy: torch.Tensor  # [S] bool
    # what the MTP layer has not consumed yet, per position from `mtp_start` on (at most k + 1): the main
    # model's hidden state there and the token after it (the last: the token sampled last, the main model's next)
    pending_hidden: torch.Tensor  # [S, K+1, D] model dtype
    pending_tokens: torch.Tensor  # [S, K+1] int64
    pending_count: torch.Tensor  # [S] int64
    mtp_start: torch.Tensor  # [S] int64

    @staticmethod
    def allocate(slots: int, k: int, hidden_size: int, dtype: torch.dtype, device) -> _SlotInputs:
        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(*shape, dtype=dtype, device=device)

        return _SlotInputs(
            zeros(3, slots), zeros(slots), zeros(slots, dtype=torch.float32), zeros(slots, dtype=torch.bool),
            zeros(slots, k + 1, hidden_size, dtype=dtype), zeros(slots, k + 1), zeros(slots), zeros(slots),
        )  # fmt: skip

    def grown(self, slots: int) -> _SlotInputs:
        """A copy with `slots` slots, the current ones kept."""
        out = []
        for t in vars(self).values():
            dim = 1 if t is self.control else 0
            shape = list(t.shape)
            shape[dim] = slots
            new = t.new_zeros(shape)
            new.narrow(dim, 0, t.shape[dim]).copy_(t)
            out.append(new)
        return _SlotInputs(*out)


@dataclass
class SpeculativeStats:
    """Counts since the engine was built: rounds run, draft tokens proposed and kept over all requests, and
    requests' rounds that kept all their drafts (then a bonus token) or rejected one."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    all_kept: int = 0
    rejected: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


_UNSUPPORTED = (
    ("top_k", lambda p: p.top_k > 0),
    ("top_p", lambda p: p.top_p < 1.0),
    ("min_p", lambda p: p.min_p > 0.0),
    ("repetition_penalty", lambda p: p.repetition_penalty != 1.0),
    ("min_tokens", lambda p: p.min_tokens > 0),
)


def unsupported_sampling(params: SamplingParams) -> list[str]:
    """The sampling settings of `params` this path does not implement (empty: it can serve them)."""
    return [name for name, used in _UNSUPPORTED if used(params)]


def check_sampling(params: SamplingParams) -> None:
    """Raises ValueError naming the sampling settings of `params` this path does not implement."""
    bad = unsupported_sampling(params)
    if bad:
        raise ValueError(f"speculative decoding does not implement {bad} yet (temperature and greedy only)")


class SpeculativeEngine:
    """Generate with MTP drafts verified by the main model (the module docstring gives the rule).

    Args:
        model: a local MoeCausalLM with MTP layers (`mtp_num_hidden_layers` > 0).
        eos_token_ids: tokens that end a request (unless its `ignore_eos`).
        num_draft_tokens: k, draft tokens per round (>= 1).
        seed, weights_version: keys of the uniform streams of requests without their own seed (as
            `GenerationEngine` keys its streams).
        max_positions: the longest prompt accepted (the model's max_position_embeddings), None: any.
        max_num_seqs: slots at most (requests running at once), None: no limit.
        device_graphs: run each round (after the prompts' prefill) as a captured device graph per slot
            bucket (`graphs.DeviceGraphs`); None: on cuda in bf16 / fp32 (as `GenerationEngine`).
    Raises:
        ValueError: a model without MTP layers, k < 1 or max_num_seqs < 1.
    """

    def __init__(
        self,
        model: MoeCausalLM,
        eos_token_ids: Iterable[int],
        num_draft_tokens: int = 2,
        seed: int = 0,
        weights_version: int = 0,
        max_positions: int | None = None,
        max_num_seqs: int | None = None,
        device_graphs: bool | None = None,
    ):
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        if max_num_seqs is not None and max_num_seqs < 1:
            raise ValueError(f"{ROLLOUT_KEY}.max_num_seqs must be >= 1, got {max_num_seqs}")
        self.max_positions, self.max_num_seqs = max_positions, max_num_seqs
        self.model, self.k = model, num_draft_tokens
        self.decoder = MoeDecoder(model)
        self.uniforms = resolve("sampling.uniforms")  # each request's numbers of its own stream
        self.drafter = MtpDrafter(self.decoder)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.seed, self.weights_version = seed, weights_version
        self.stats = SpeculativeStats()
        self.last_round: dict[str, tuple[int, int]] = {}  # request id -> (drafted, accepted) in the last round
        self._finished_stats: dict[str, dict[str, int]] = {}  # request id -> counts, until take_request_stats
        self._copies: Counter[tuple] = Counter()
        self._seqs: list[_Seq | None] = []
        self.state: SlotState | None = None
        self.mtp_cache: MtpCache | None = None
        self.inputs: _SlotInputs | None = None
        if device_graphs is None:
            device_graphs = graphs_by_default(self.decoder)
        self.graphs = DeviceGraphs(self.decoder.device) if device_graphs else None

    @property
    def num_running(self) -> int:
        return sum(s is not None for s in self._seqs)

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """Run `requests` to completion; completions in the order of `requests`."""
        done = {c.request_id: c for c in self.add(requests)}
        while self.num_running:
            done.update((c.request_id, c) for c in self.step())
        return [done[r.request_id] for r in requests]

    @torch.no_grad()
    def add(self, requests: Sequence[Request]) -> list[Completion]:
        """Prefill `requests` into free slots and sample their first tokens; returns those already finished.

        Raises:
            ValueError: a bad prompt, a duplicate request id, or a sampling setting this path does not
                implement (named). Nothing is admitted then.
        """
        if not requests:
            return []
        self._check(requests)
        slots = self._take_slots(requests)
        dev, prompts = self.decoder.device, [list(r.prompt_ids) for r in requests]
        slot_rows = to_device(torch.tensor(slots, dtype=torch.long), dev)
        self.state.lengths[slot_rows] = 0
        seqs = [_Seq(r, i, self._stream(r)) for r, i in zip(requests, slots)]
        hidden = self.decoder.extend(prompts, self.state, slots)
        ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        last_hidden = hidden[to_device(ends, dev)]
        temps, greedy = self._temperatures(seqs)
        x, lp = self._first_tokens(self.model.logits(last_hidden), seqs, temps, greedy)
        # the MTP layer consumes each prompt but its last position now (position s: hidden state at s, token
        # s + 1); the last, with the first token, is the first round's to consume
        longer = [n for n, p in enumerate(prompts) if len(p) > 1]
        if longer:
            begins = [int(ends[n]) + 1 - len(prompts[n]) for n in longer]
            self.drafter.forward(
                torch.cat([hidden[b : int(ends[n])] for b, n in zip(begins, longer)]),
                [prompts[n][1:] for n in longer], self.mtp_cache, [slots[n] for n in longer], [0] * len(longer),
            )  # fmt: skip
        b = self.inputs
        b.pending_hidden[slot_rows, 0] = last_hidden
        b.pending_tokens[slot_rows, 0] = x
        b.pending_count[slot_rows] = 1
        b.mtp_start[slot_rows] = to_device(torch.tensor([len(p) - 1 for p in prompts]), dev)
        b.streams[slot_rows] = to_device(torch.tensor([s.stream or 0 for s in seqs], dtype=torch.int64), dev)
        b.temps[slot_rows], b.greedy[slot_rows] = temps, greedy
        for s, x_n, lp_n in zip(seqs, x.tolist(), lp.tolist()):
            self._seqs[s.slot] = s
            self._emit(s, [x_n], [lp_n])
        return self._collect(slots)

    def step(self, steps: int = 1) -> list[Completion]:
        """Rounds until every running request has gained at least `steps` tokens or finished (at most
        `steps` rounds: a round gives each request 1 to k + 1 tokens). Returns those that finished."""
        start = {s.request.request_id: len(s.tokens) for s in self._seqs if s is not None}
        done: list[Completion] = []
        while any(s is not None and len(s.tokens) - start[s.request.request_id] < steps for s in self._seqs):
            done += self._round()
        return done

    @property
    def sizes(self) -> dict[str, int]:
        """What the slots have room for now, as `reserve` takes it (all 0 before the first request)."""
        return {"slots": len(self._seqs), "positions": self.mtp_cache.capacity if self.mtp_cache is not None else 0}

    def reserve(self, slots: int, positions: int) -> None:
        """Allocate `slots` slots (at most max_num_seqs) of `positions` positions up front, in both the main
        model's and the MTP layer's caches."""
        if slots > 0:
            self._grow(slots if self.max_num_seqs is None else min(slots, self.max_num_seqs), positions)

    def set_weights_version(self, weights_version: int) -> None:
        """Key the uniform streams of requests admitted from now on by `weights_version`, as `GenerationEngine`
        keys its streams (arrival ranks count from zero again).

        Raises:
            ValueError: requests are running.
        """
        if self.num_running:
            raise ValueError("weights version changed while requests run; abort or drain them first")
        self.weights_version = weights_version
        self._copies.clear()

    def abort_all(self) -> list[Completion]:
        """Stop every running request; each returns what it generated so far (finish_reason "abort")."""
        for s in self._seqs:
            if s is not None:
                s.finish = "abort"
        return self._collect(range(len(self._seqs)))

    def take_request_stats(self) -> dict[str, dict[str, int]]:
        """Per request finished (or aborted) since the last call: {"spec_num_draft_tokens",
        "spec_num_accepted_tokens", "spec_num_verify_steps"} (draft tokens proposed, kept, and rounds that
        verified drafts), the keys verl's trainer turns into `rollout/spec_accept_rate` and `_length`."""
        stats, self._finished_stats = self._finished_stats, {}
        return stats

    @torch.no_grad()
    def _round(self) -> list[Completion]:
        """One round for every running request: draft, verify, accept, commit (`_round_on_device`, over the
        slots up to the highest running one), then the round's one read. Returns those that finished."""
        seqs = [s for s in self._seqs if s is not None]
        if not seqs:
            return []
        K = self.k
        rows = 1 << max(s.slot for s in seqs).bit_length()  # a power of two above the highest running slot
        rows = min(rows, len(self._seqs))
        ks = [min(K, s.request.params.max_tokens - len(s.tokens) - 1) for s in seqs]
        control = torch.zeros(3, rows, dtype=torch.int64)
        control[:, [s.slot for s in seqs]] = torch.tensor([ks, [1] * len(seqs), [s.draws for s in seqs]])
        self.inputs.control[:, :rows].copy_(to_device(control, self.decoder.device))
        # per slot: j, the round's last token, the drafts, the emitted tokens' log-probs; fp64 holds token ids exactly
        if self.graphs is None:
            read = self._round_on_device(rows)
        else:
            shapes = tuple(tuple(t.shape) for cache in self.state.layers for t in vars(cache).values())
            signature = ("round", rows, K, self.decoder.dtype, shapes, tuple(self.mtp_cache.attention.k.shape))
            read = self.graphs.run(rows, lambda: self._round_on_device(rows), self.inputs.control[1], signature)
        read = read.tolist()
        self.last_round = {}
        for s, k in zip(seqs, ks):
            row = read[s.slot]
            j = int(row[0])
            emitted = [int(t) for t in row[2 : 2 + j]] + [int(row[1])]
            if s.stream is not None:
                s.draws += 2 * K + 1
            if j < k:
                self.stats.rejected += 1
            elif j > 0:
                self.stats.all_kept += 1
            self.stats.drafted += k
            self.stats.accepted += j
            s.drafted, s.accepted, s.verified = s.drafted + k, s.accepted + j, s.verified + (k > 0)
            self.last_round[s.request.request_id] = (k, j)
            self._emit(s, emitted, row[2 + K : 3 + K + j])
        self.stats.rounds += 1
        return self._collect([s.slot for s in seqs])

    def _round_on_device(self, rows: int) -> torch.Tensor:
        """The round over slots [0, rows) from `self.inputs` (its control rows written), on the device and
        reading nothing back: returns [rows, 2 + K + K + 1] fp64, per slot j (drafts kept), the round's last
        token, the K drafts and the log-probs of the K + 1 tokens the verified positions emit (the first j + 1
        are the round's); advances the slots, the MTP cache and the pending positions of the active slots."""
        K, b, dev = self.k, self.inputs, self.decoder.device
        active = b.control[1, :rows] > 0  # all false while a graph captures: the round then changes nothing
        ks, draws = torch.where(active, b.control[0, :rows], 0), b.control[2, :rows]
        temps, greedy = torch.where(active, b.temps[:rows], 1.0), b.greedy[:rows]
        # each request's numbers draws .. draws + 2K of its stream: k draft draws, k acceptance numbers, the last
        index = draws[:, None] + torch.arange(2 * K + 1, device=dev)
        u = self.uniforms(b.streams[:rows, None].expand_as(index).reshape(-1), index.reshape(-1)).view(rows, -1)
        drafted, q = self._draft(rows, ks, active, temps, greedy, u[:, :K])
        # the verification: each slot's last token then its drafts (zeros past its k: positions after its
        # k + 1 are never kept nor read)
        pending, count = b.pending_tokens[:rows], b.pending_count[:rows]
        last = pending.gather(1, (count - 1).clamp(min=0)[:, None])
        hidden, steps = self.decoder.verify(torch.cat([last, drafted], 1), self.state, active)
        target = self.model.logits(hidden.flatten(0, 1)).float().view(rows, K + 1, -1)
        scaled = target / temps[:, None, None]
        j, y = accept_greedy(target, drafted, ks)
        js, ys = accept_drafts(torch.softmax(scaled, -1), q, drafted, ks, u[:, K : 2 * K], u[:, 2 * K])
        j, y = torch.where(greedy, j, js), torch.where(greedy, y, ys)
        self.decoder.commit(steps, torch.where(active, j + 1, 0), self.state, active)
        # the token each verified position emits (draft i before j, y at j) and the target's log-prob of it
        position = torch.arange(K + 1, device=dev)
        emit = torch.cat([drafted, y[:, None]], 1).gather(1, torch.where(position < j[:, None], position, K))
        log_p = scaled.log_softmax(-1).gather(-1, emit[..., None])[..., 0]
        # the next round's catch-up: the j + 1 kept positions, their hidden states and the tokens after them
        b.pending_hidden[:rows] = torch.where(active[:, None, None], hidden, b.pending_hidden[:rows])
        b.pending_tokens[:rows] = torch.where(active[:, None], emit, pending)
        b.pending_count[:rows] = torch.where(active, j + 1, count)
        return torch.cat([j[:, None], y[:, None], drafted, log_p], 1).double()

    def _draft(
        self,
        rows: int,
        ks: torch.Tensor,
        active: torch.Tensor,
        temps: torch.Tensor,
        greedy: torch.Tensor,
        u: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to ks[n] draft tokens per slot of [0, rows), drawn with the uniforms u [rows, K]: [rows, K] int64
        (0 past ks[n]) and their draft distributions q [rows, K, VOCAB] fp32 (zero past ks[n] and for greedy
        requests). The MTP layer's catch-up over each slot's pending positions (K + 1 per slot, those past its
        count write nothing), then each further draft as one position of every slot (rows past their k write
        nothing)."""
        K, b, dev = self.k, self.inputs, self.decoder.device
        count, start = b.pending_count[:rows], b.mtp_start[:rows]
        slots, position = torch.arange(rows, device=dev), torch.arange(K + 1, device=dev)
        consumed = active[:, None] & (position < count[:, None])
        out = self.drafter.step(
            b.pending_hidden[:rows], b.pending_tokens[:rows], start[:, None] + position, self.mtp_cache, slots,
            consumed,
        )  # fmt: skip
        g = out[slots, (count - 1).clamp(min=0)]  # the output at each slot's last consumed position
        start = start + count  # the position each slot's next draft step writes
        b.mtp_start[:rows] = torch.where(active, start, b.mtp_start[:rows])
        drafted = torch.zeros(rows, K, dtype=torch.int64, device=dev)
        q_all = None
        for i in range(K):
            logits = self.model.logits(g).float()
            q = torch.softmax(logits / temps[:, None], -1)
            tokens = torch.where(greedy, logits.argmax(-1), inverse_cdf(q, u[:, i]))
            live = ks > i
            if q_all is None:
                q_all = q.new_zeros(rows, K, q.shape[-1])
            q_all[:, i] = torch.where((greedy | ~live)[:, None], 0.0, q)
            drafted[:, i] = torch.where(live, tokens, 0)
            if i + 1 < K:
                # the layer's output at s stands in for the main hidden state at s + 1 (speculative positions,
                # written again by the next round's catch-up)
                g = self.drafter.step(
                    g[:, None], tokens[:, None], (start + i)[:, None], self.mtp_cache, slots, (ks > i + 1)[:, None]
                )[:, 0]
        return drafted, q_all

    def _temperatures(self, seqs: Sequence[_Seq]) -> tuple[torch.Tensor, torch.Tensor]:
        """[N] fp32 temperatures (1 for greedy requests) and [N] bool greedy, on the device."""
        dev = self.decoder.device
        temps = [1.0 if s.stream is None else s.request.params.temperature for s in seqs]
        greedy = [s.stream is None for s in seqs]
        return to_device(torch.tensor(temps), dev), to_device(torch.tensor(greedy), dev)

    def _uniforms(self, seqs: Sequence[_Seq], count: int) -> torch.Tensor:
        """[N, count] fp64 on the device: numbers draws .. draws + count - 1 of each request's stream (a
        greedy request's row is never read)."""
        streams = torch.tensor([0 if s.stream is None else s.stream for s in seqs], dtype=torch.int64)
        index = torch.tensor([s.draws for s in seqs], dtype=torch.int64)[:, None] + torch.arange(count)
        streams = streams[:, None].expand(-1, count).reshape(-1)
        dev = self.decoder.device
        streams, index = to_device(torch.stack([streams, index.reshape(-1)]), dev)
        return self.uniforms(streams, index).view(len(seqs), count)

    def _first_tokens(
        self, logits: torch.Tensor, seqs: Sequence[_Seq], temps: torch.Tensor, greedy: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens after the prompts: argmax, or an inverse-CDF draw with number 0 of the request's stream;
        and their log-probs. logits: [N, VOCAB]; temps, greedy: `_temperatures(seqs)`."""
        lp = (logits.float() / temps[:, None]).log_softmax(-1)
        x = lp.argmax(-1)
        if not bool(greedy.all()):
            x = torch.where(greedy, x, inverse_cdf(lp.exp(), self._uniforms(seqs, 1)[:, 0]))
        for s in seqs:
            if s.stream is not None:
                s.draws = 1
        return x, lp.gather(-1, x[:, None])[:, 0]

    def _emit(self, s: _Seq, tokens: list[int], log_probs: list[float]) -> None:
        """Record tokens until one ends the request (a stop id, or max_tokens reached)."""
        p = s.request.params
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
        for t, lp in zip(tokens, log_probs):
            s.tokens.append(t)
            s.log_probs.append(lp)
            if t in stops:
                s.finish = "stop"
            elif len(s.tokens) >= p.max_tokens:
                s.finish = "length"
            if s.finish:
                return

    def _collect(self, slots: Sequence[int]) -> list[Completion]:
        done = []
        for i in slots:
            s = self._seqs[i]
            if s is not None and s.finish is not None:
                lps = s.log_probs if s.request.params.logprobs else None
                done.append(Completion(s.request.request_id, s.tokens, lps, s.finish))
                self._finished_stats[s.request.request_id] = {
                    "spec_num_draft_tokens": s.drafted,
                    "spec_num_accepted_tokens": s.accepted,
                    "spec_num_verify_steps": s.verified,
                }
                self._seqs[i] = None
        return done

    # ---- slots and requests -----------------------------------------------------------------------

    def _take_slots(self, requests: Sequence[Request]) -> list[int]:
        """Free slots for `requests`, the slots (and both caches) reallocated when too few or too short.

        Raises:
            ValueError: more requests than free slots (max_num_seqs).
        """
        free = [i for i, s in enumerate(self._seqs) if s is None]
        running = len(self._seqs) - len(free)
        if self.max_num_seqs is not None and running + len(requests) > self.max_num_seqs:
            raise ValueError(
                f"{len(requests)} requests do not fit: {running} of max_num_seqs={self.max_num_seqs} slots are running "
                f"({ROLLOUT_KEY}.max_num_seqs)"
            )
        self._grow(
            len(self._seqs) + max(0, len(requests) - len(free)),
            max(len(r.prompt_ids) + r.params.max_tokens for r in requests),
        )
        return [i for i, s in enumerate(self._seqs) if s is None][: len(requests)]

    def _grow(self, slots: int, need: int) -> None:
        """At least `slots` slots of `need` positions in both caches (what is there is kept)."""
        if self.state is None:
            self.state = self.decoder.allocate(slots, need)
            self.mtp_cache = self.drafter.allocate(slots, need)
            arch = self.model.arch
            self.inputs = _SlotInputs.allocate(slots, self.k, arch.hidden_size, self.decoder.dtype, self.decoder.device)
        elif slots > self.state.num_slots or need > self.mtp_cache.capacity:
            slots = max(slots, self.state.num_slots)
            capacity = max(need, self.mtp_cache.capacity)
            self.state.resize(slots, max(capacity, self.state.capacity or 0))
            grown = self.drafter.allocate(slots, capacity)
            old = self.mtp_cache.attention
            for new, t in ((grown.attention.k, old.k), (grown.attention.v, old.v)):
                new[: t.shape[0], :, : t.shape[2]] = t
            self.mtp_cache = grown
            self.inputs = self.inputs.grown(slots)
            if self.graphs is not None:  # they read the old tensors
                self.graphs.clear()
        self._seqs += [None] * max(0, slots - len(self._seqs))

    def _check(self, requests: Sequence[Request]) -> None:
        running = {s.request.request_id for s in self._seqs if s is not None}
        seen: set[str] = set()
        for r in requests:
            if r.request_id in running or r.request_id in seen:
                raise ValueError(f"request {r.request_id!r} is already running or given twice")
            seen.add(r.request_id)
            try:
                check_prompt(r.prompt_ids, self.model.arch.vocab_size, self.max_positions)
                check_sampling(r.params)
            except ValueError as e:
                raise ValueError(f"request {r.request_id!r}: {e}") from None

    def _stream(self, r: Request) -> int | None:
        """The key of the request's uniforms: its seed, or derived as `GenerationEngine` derives it; None
        for a greedy request."""
        params: SamplingParams = r.params
        if params.greedy:
            return None
        if params.seed is not None:
            return params.seed
        copy = (r.prompt_ids, r.sample_key)
        stream = stream_seed(self.seed, self.weights_version, r.prompt_ids, f"{r.sample_key}/{self._copies[copy]}")
        self._copies[copy] += 1
        return stream


__all__ = [
    "SpeculativeEngine",
    "SpeculativeStats",
    "accept_drafts",
    "accept_greedy",
    "check_sampling",
    "unsupported_sampling",
]
