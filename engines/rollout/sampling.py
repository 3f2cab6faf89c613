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
4. log-softmax of what remains and the draw (the sampling op, `ops/sampling`): greedy rows take the
   argmax, the others draw from it by inverting
   its CDF at a number of the request's own stream (`stream_uniform`), so what a row draws does not
   depend on the other rows. Streams are counter-based hashes rather than torch generators: one
   batched draw for all rows (a generator per row costs host work per row on a GPU), computed on the
   device (the op `sampling.uniforms`: splitmix64, the same numbers as the host's `stream_uniform`)
   and the same numbers on every device.
Every per-row setting is a tensor (`SamplingRows`), so a decode step samples with no host round-trip.
verl's trainer computes log_softmax(logits / temperature) over the whole vocabulary, so with
top_k=-1, top_p=1, min_p=0 (the defaults) rollout and trainer log-probs are the same quantity.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ...ops import resolve
from ...ops.sampling.uniforms import stream_uniform
from .config import ROLLOUT_KEY, ROLLOUT_NAME

GREEDY_EPS = 1e-5  # vLLM's: temperatures below it mean greedy
# Keys verl's agent loops and LLMServerClient send that change nothing here.
_IGNORED_KEYS = ("n", "detokenize", "skip_special_tokens", "spaces_between_special_tokens")
# what verl's agent loop takes from its rollout config (or val_kwargs) into every request
_VERL_SET = ("temperature", "top_p", "top_k")


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
        for name, ok, bounds in (
            ("max_tokens", self.max_tokens >= 1, ">= 1"),
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
            ("min_tokens", self.min_tokens >= 0, ">= 0"),
        ):
            if not ok:
                where = f" ({ROLLOUT_KEY}.{name}; val_kwargs.{name} in validation)" if name in _VERL_SET else ""
                raise ValueError(f"sampling parameter {name} must be {bounds}, got {getattr(self, name)}{where}")

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
            raise ValueError(
                f"sampling parameter(s) {unknown} not supported by the {ROLLOUT_NAME} rollout; it takes {sorted(known)}"
            )
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


def _hash64(*values) -> int:
    return int.from_bytes(hashlib.blake2b(repr(values).encode(), digest_size=8).digest(), "little")


@dataclass
class SamplingRows:
    """N rows' settings as tensors on the logits' device ([N] each): temperature (1 for greedy rows),
    greedy, top_k (0 or >= VOCAB: off), top_p, min_p, penalty (repetition), uniform (the row's
    stream number for this token, fp64; ignored for greedy rows). The `use_*` flags say whether any
    row needs a step (what no row needs is skipped); they are the caller's to keep true."""

    temperature: torch.Tensor
    greedy: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    penalty: torch.Tensor
    uniform: torch.Tensor
    use_top_k: bool = True
    use_top_p: bool = True
    use_min_p: bool = True
    use_penalty: bool = True

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], uniforms: Sequence[float | None], device: torch.device | str
    ) -> SamplingRows:
        """From N SamplingParams and their numbers (None only for greedy rows)."""
        if any(u is None and not p.greedy for p, u in zip(params, uniforms)):
            raise ValueError("every sampled row needs a number of its own stream")
        values = settings_of(params)
        tensors = {k: torch.tensor(v, dtype=SETTING_DTYPES[k], device=device) for k, v in values.items()}
        u = torch.tensor([0.0 if x is None else x for x in uniforms], dtype=torch.float64, device=device)
        return cls(uniform=u, **tensors, **uses_of(params))


SETTING_DTYPES = {
    "temperature": torch.float32,
    "greedy": torch.bool,
    "top_k": torch.long,
    "top_p": torch.float32,
    "min_p": torch.float32,
    "penalty": torch.float32,
}


def settings_of(params: Sequence[SamplingParams]) -> dict[str, list]:
    """The per-row tensors' values of `SamplingRows` (all but uniform) for these params."""
    return {
        "temperature": [1.0 if p.greedy else p.temperature for p in params],
        "greedy": [p.greedy for p in params],
        "top_k": [max(p.top_k, 0) for p in params],
        "top_p": [p.top_p for p in params],
        "min_p": [p.min_p for p in params],
        "penalty": [p.repetition_penalty for p in params],
    }


def uses_of(params: Sequence[SamplingParams]) -> dict[str, bool]:
    """`SamplingRows`' use_* flags for rows with these params."""
    return {
        "use_top_k": any(p.top_k > 0 for p in params),
        "use_top_p": any(p.top_p < 1.0 for p in params),
        "use_min_p": any(p.min_p > 0.0 for p in params),
        "use_penalty": any(p.repetition_penalty != 1.0 for p in params),
    }


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    uniforms: Sequence[float | None],
    seen: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row (`sample_rows` with the settings of `params`).

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
    return sample_rows(logits, SamplingRows.from_params(params, uniforms, logits.device), seen)


def sample_rows(
    logits: torch.Tensor, rows: SamplingRows, seen: torch.Tensor | None = None, draw: Callable | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` with the settings as tensors: no value is read back to the host. The filters (repetition
    penalty, top-k, top-p, min-p) run only when a row needs one, on the temperature-scaled fp32 logits;
    the draw itself is the sampling op (`draw`, default `resolve("sampling")`)."""
    temperature = rows.temperature
    if rows.use_penalty or rows.use_top_k or rows.use_top_p or rows.use_min_p:
        x = logits.float()
        if seen is not None and rows.use_penalty:
            pen = rows.penalty[:, None]
            x = torch.where(seen, torch.where(x > 0, x / pen, x * pen), x)
        x = x / temperature[:, None]
        if rows.use_top_k:
            x = _mask_top_k(x, rows.top_k)
        if rows.use_top_p or rows.use_min_p:
            x = _mask_top_p_min_p(x, rows.top_p if rows.use_top_p else None, rows.min_p if rows.use_min_p else None)
        logits, temperature = x, torch.ones_like(temperature)  # scaled already
    return (draw or resolve("sampling"))(logits, temperature, rows.greedy, rows.uniform)


def _mask_top_k(x: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    vocab = x.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    kth = x.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])  # [N, 1]
    return x.masked_fill(x < kth, float("-inf"))


def _mask_top_p_min_p(x: torch.Tensor, top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    probs = torch.softmax(x, dim=-1)
    if top_p is not None:
        p = top_p[:, None]
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
        drop_sorted = (mass_before >= p) & (p < 1.0)  # p = 1 keeps all, whatever the rounding of the sum
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    if min_p is not None:
        m = min_p[:, None]
        x = x.masked_fill(probs < m * probs.max(-1, keepdim=True).values, float("-inf"))
    return x


__all__ = [
    "GREEDY_EPS",
    "SamplingParams",
    "SamplingRows",
    "sample",
    "sample_rows",
    "settings_of",
    "stream_seed",
    "stream_uniform",
    "uses_of",
]
