"""Speculative decoding where it pays: a speculative engine for small batches beside the plain engine for
large ones.

A speculative round verifies k + 1 positions of every running request; with many requests running, the
plain decode step (device graphs, one position per request) already keeps the device busy and the
drafts' extra work only costs. So each engine call admits its new requests to the speculative engine when
the requests then running (in both engines, the new ones included) number at most `max_speculative`, and
to the plain engine otherwise; a request stays with the engine that admitted it until it finishes. A wave
of requests larger than the bound (an RL step's batch) decodes in the plain engine as if speculation were
off; a few requests at a time (serving) decode speculatively. A call with a request whose
sampling settings the speculative path does not implement (top-k, top-p, min-p, repetition penalty,
min_tokens) goes to the plain engine whatever the load.

Which engine serves a request depends on what else runs when it arrives, and the two engines draw a
sampled request's tokens from different random numbers (both from the target's distribution): give the
bound 0 (never speculate) or above max_num_seqs (always) where a request's tokens must not depend on the
load.
"""

from __future__ import annotations

from collections.abc import Sequence

from .engine import Completion, GenerationEngine, Request
from .speculative import SpeculativeEngine, unsupported_sampling


class SpeculativeWhereItPays:
    """The rollout engine interface (`add`, `step`, `num_running`, `sizes` / `reserve`,
    `set_weights_version`, `abort_all`, `take_request_stats`) over a speculative and a plain engine of
    one model, routing each call's new requests as the module docstring says.

    Args:
        speculative, plain: the two engines (sharing the model, each with its own slots).
        max_speculative: new requests go to the speculative engine when at most this many requests
            run with them, else to the plain engine.
    """

    def __init__(self, speculative: SpeculativeEngine, plain: GenerationEngine, max_speculative: int):
        if max_speculative < 0:
            raise ValueError(f"max_speculative must be >= 0, got {max_speculative}")
        self.speculative, self.plain, self.max_speculative = speculative, plain, max_speculative
        self.engines = (speculative, plain)

    @property
    def k(self) -> int:
        return self.speculative.k

    @property
    def num_running(self) -> int:
        return sum(e.num_running for e in self.engines)

    def add(self, requests: Sequence[Request]) -> list[Completion]:
        """Admit `requests` into one engine (the one the load picks); returns those already finished."""
        if not requests:
            return []
        speculate = self.num_running + len(requests) <= self.max_speculative and not any(
            unsupported_sampling(r.params) for r in requests
        )
        return (self.speculative if speculate else self.plain).add(requests)

    def step(self, steps: int = 1) -> list[Completion]:
        """Each engine with running requests advances them (the speculative one by at least `steps` tokens
        each); returns those that finished."""
        return [c for e in self.engines if e.num_running for c in e.step(steps)]

    @property
    def sizes(self) -> dict[str, dict[str, int]]:
        return {"speculative": self.speculative.sizes, "plain": self.plain.sizes}

    def reserve(self, speculative: dict[str, int], plain: dict[str, int]) -> None:
        """Each engine's slots as large as `sizes` said (a new router starting where an old one ended)."""
        self.speculative.reserve(**speculative)
        self.plain.reserve(**plain)

    def set_weights_version(self, weights_version: int) -> None:
        for e in self.engines:
            e.set_weights_version(weights_version)

    def abort_all(self) -> list[Completion]:
        return [c for e in self.engines for c in e.abort_all()]

    def take_request_stats(self) -> dict[str, dict[str, int]]:
        """The speculative engine's draft counts of its finished requests (the plain engine drafts none)."""
        return self.speculative.take_request_stats()


__all__ = ["SpeculativeWhereItPays"]
