"""Sampling parameters as verl's agent loop sends them, and one batched sampling step.

What a step computes, per row, in vLLM's order and with vLLM's meaning (verl's default
`logprobs_mode=processed_logprobs`: the log-prob of the sampled token under the distribution it
was drawn from):
1. logits in fp32; repetition penalty on tokens seen in the prompt or output (positive logits
   divided by it, negative ones multiplied);
2. temperature: a row with temperature < 1e-5 is greedy, and its distribution is taken at
   temperature 1 (vLLM's greedy log-probs are of the unscaled logits);
3. top-k (k <= 0 or >= VOCAB: off), then top-p (keep the smallest set of most likely tokens whose
   mass reaches p; the most likely token always stays), then min-p (drop tokens whose probability
   is below min_p times the largest);
4. log-softmax of what remains; greedy rows take the argmax, the others draw from it by inverting
   its CDF at a number of the request's own stream (`stream_uniform`), so what a row draws does not
   depend on the other rows. Streams are counter-based hashes rather than torch generators: one
   batched draw for all rows (a generator per row costs ~0.16 ms per row on a GPU) and the same
   numbers on every device.
verl's trainer computes log_softmax(logits / temperature) over the whole vocabulary, so with
top_k=-1, top_p=1, min_p=0 (the defaults) rollout and trainer log-probs are the same quantity.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

GREEDY_EPS = 1e-5  # vLLM's: temperatures below it mean greedy
# Keys verl's agent loops and LLMServerClient send that change nothing here.
_IGNORED_KEYS = ("n", "detokenize", "skip_special_tokens", "spaces_between_special_tokens")


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings (vLLM's names and defaults).

    Attributes:
        max_tokens: new tokens at most (the server fills it in; >= 1).
        temperature, top_k, top_p, min_p, repetition_penalty: see the module docstring.
        logprobs: return the sampled tokens' log-probs (verl sends a bool).
        seed: the request's own stream (vLLM's per-request seed), or None for one the engine derives.
        ignore_eos: keep going past end-of-sequence tokens. stop_token_ids: more tokens that end it.
        min_tokens: end-of-sequence and stop tokens do not end the request before this many tokens.
    """

    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: bool = False
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    min_tokens: int = 0

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @classmethod
    def from_request(cls, params: Mapping, max_tokens: int) -> SamplingParams:
        """From the dict verl sends (`temperature`, `top_p`, `top_k`, `repetition_penalty`, `logprobs`,
        optionally `seed`, `ignore_eos`, ...); `max_tokens`/`max_new_tokens` keys are the caller's
        business (the server has resolved them into `max_tokens`).

        Raises:
            ValueError: a key this sampler does not implement (named), or a bad value.
        """
        known = {"temperature", "top_k", "top_p", "min_p", "repetition_penalty", "logprobs", "seed", "ignore_eos"}
        known |= {"stop_token_ids", "min_tokens", "max_tokens", "max_new_tokens"}
        given = {k for k, v in params.items() if v is not None}  # None means "not set"
        unknown = sorted(given - known - set(_IGNORED_KEYS))
        if unknown:
            raise ValueError(f"sampling parameter(s) {unknown} not supported by the verl_moe rollout")
        kwargs = {k: params[k] for k in known - {"max_tokens", "max_new_tokens"} if params.get(k) is not None}
        if "logprobs" in kwargs:
            kwargs["logprobs"] = bool(kwargs["logprobs"])
        if "stop_token_ids" in kwargs:
            kwargs["stop_token_ids"] = tuple(int(t) for t in kwargs["stop_token_ids"])
        for name, kind in (("top_k", int), ("seed", int), ("min_tokens", int)):
            if name in kwargs:
                kwargs[name] = kind(kwargs[name])
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            if name in kwargs:
                kwargs[name] = float(kwargs[name])
        return cls(max_tokens=int(max_tokens), **kwargs)


def stream_seed(seed: int, weights_version: int, prompt_ids: Sequence[int], key: str) -> int:
    """The stream of a request without its own seed, in [0, 2**63): a hash of the rollout seed, the
    weights version, the prompt and `key` (what tells identical prompts apart). A hash rather than a
    sum, so nearby seeds, steps and prompts do not share streams."""
    return _hash64(int(seed), int(weights_version), [int(t) for t in prompt_ids], str(key)) >> 1


def stream_uniform(stream: int, index: int) -> float:
    """Number `index` of stream `stream`: uniform in [0, 1) with 53 random bits, a hash of both."""
    return (_hash64(int(stream), int(index)) >> 11) * 2.0**-53


def _hash64(*values) -> int:
    return int.from_bytes(hashlib.blake2b(repr(values).encode(), digest_size=8).digest(), "little")


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    uniforms: Sequence[float | None],
    seen: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row.

    Args:
        logits: [N, VOCAB] next-token logits (any float dtype).
        params: N SamplingParams. uniforms: N numbers in [0, 1), None only for greedy rows: row n
            takes the first token (in vocabulary order) where the CDF of its processed distribution
            exceeds uniforms[n] times the total (inverse-CDF sampling, as torch.multinomial draws).
        seen: [N, VOCAB] bool, tokens of each row's prompt and output (needed only when a row has a
            repetition penalty != 1).
    Returns:
        tokens [N] int64 and their log-probs [N] fp32 under the processed distribution.
    Raises:
        ValueError: a sampled (not greedy) row without its number.
    """
    N, vocab = logits.shape
    x = logits.float()
    device = x.device
    penalty = torch.tensor([p.repetition_penalty for p in params], device=device)
    if seen is not None and bool((penalty != 1.0).any()):
        pen = penalty[:, None]
        x = torch.where(seen, torch.where(x > 0, x / pen, x * pen), x)
    temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device)
    x = x / temperature[:, None]
    x = _mask_top_k(x, [p.top_k for p in params], vocab)
    x = _mask_top_p_min_p(x, [p.top_p for p in params], [p.min_p for p in params])
    logprobs = torch.log_softmax(x, dim=-1)
    tokens = x.argmax(-1)
    sampled = [n for n in range(N) if not params[n].greedy]
    if any(uniforms[n] is None for n in sampled):
        raise ValueError("every sampled row needs a number of its own stream")
    if sampled:
        rows = torch.tensor(sampled, device=device)
        # fp64: a parallel scan may round a masked (zero-probability) token's CDF one ulp above its
        # neighbour's, leaving it a ~1e-16 chance in fp64 (~1e-7 in fp32, times the masked tokens)
        cdf = logprobs[rows].double().exp().cumsum(-1)
        total = cdf[:, -1:]
        u = torch.tensor([uniforms[n] for n in sampled], dtype=torch.float64, device=device)[:, None]
        target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        tokens[rows] = torch.searchsorted(cdf, target, right=True)[:, 0]
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


def _mask_top_k(x: torch.Tensor, top_k: list[int], vocab: int) -> torch.Tensor:
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    if all(k == vocab for k in ks):
        return x
    k = torch.tensor(ks, device=x.device)
    kth = x.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])  # [N, 1]
    return x.masked_fill(x < kth, float("-inf"))


def _mask_top_p_min_p(x: torch.Tensor, top_p: list[float], min_p: list[float]) -> torch.Tensor:
    if all(p >= 1.0 for p in top_p) and all(m <= 0.0 for m in min_p):
        return x
    probs = torch.softmax(x, dim=-1)
    if any(p < 1.0 for p in top_p):
        p = torch.tensor(top_p, device=x.device)[:, None]
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    if any(m > 0.0 for m in min_p):
        m = torch.tensor(min_p, device=x.device)[:, None]
        x = x.masked_fill(probs < m * probs.max(-1, keepdim=True).values, float("-inf"))
    return x


__all__ = ["GREEDY_EPS", "SamplingParams", "sample", "stream_seed", "stream_uniform"]
