"""How to pick the next tokens of one request (vLLM's ``SamplingParams`` shape).

Every field is checked on construction, so a request that would break a step
(a NaN temperature, a seed the generator cannot take, a bias for a token the
model does not have) is refused at ``add_request`` with one clear line instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pagedkv.core.errors import RequestRejected
from pagedkv.core.limits import check_cap
from pagedkv.core.sample.structured_output import StructuredOutputs

MAX_TOKENS_LIMIT = 1 << 20  # far beyond any context window; stops a typo from meaning "forever"
MAX_LOGPROBS = 20  # vLLM's default max_logprobs and OpenAI's top_logprobs cap
MAX_SEED = 2**64 - 1  # the largest seed torch.Generator.manual_seed takes
MIN_TEMPERATURE = 1e-2  # as vLLM: smaller positive temperatures overflow logits / t, so they are raised to this
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit bias


@dataclass
class SamplingParams:
    """Sampling settings; ``temperature=0`` is greedy.

    ``seed`` makes a sampled request reproducible on its own, whatever else is
    in the batch. ``n > 1`` asks for several samples sharing the prompt.
    Penalties follow vLLM: ``repetition_penalty`` (1 = off) over prompt and
    output tokens, ``presence_penalty`` / ``frequency_penalty`` (0 = off) over
    output tokens. ``structured`` (a :class:`StructuredOutputs`, or a dict of its fields) constrains the
    output to a JSON schema, a regex, a choice or a Lark grammar. ``logprobs=k`` returns, per generated
    token, the sampled token's log-probability and the ``k`` most likely ones; ``prompt_logprobs=k``
    the same for every prompt token after the first. Log-probabilities are those
    of the raw model logits, before any penalty, bias, temperature or filter
    (vLLM's default ``raw_logprobs``).

    As vLLM: ``include_stop_str_in_output`` keeps the stop string (or stop token's text) in the
    output; ``skip_special_tokens`` / ``spaces_between_special_tokens`` go to the tokenizer's
    decode; ``bad_words`` are never generated (each word's last token is banned once the tokens
    before it were generated); ``allowed_token_ids`` restricts every draw to those ids;
    ``truncate_prompt_tokens=k`` keeps only the prompt's last ``k`` tokens (-1: the model's length).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    bad_words: list[str] = field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)  # the engine fills it
    structured: StructuredOutputs | None = None  # output constrained to a schema, regex, choice or grammar

    def __post_init__(self) -> None:
        if not self._plain():
            self._check()

    def _plain(self) -> bool:
        """The usual request, already in canonical form, checked in one expression (a simulation adds
        100k requests: the field-by-field checks with their messages run only when this says no)."""
        n, seed, temperature = self.n, self.seed, self.temperature
        return (
            type(n) is int and 1 <= n <= 8  # (larger n: checked against the configurable cap below)
            and type(self.max_tokens) is int and 1 <= self.max_tokens <= MAX_TOKENS_LIMIT
            and type(self.min_tokens) is int and 0 <= self.min_tokens <= self.max_tokens
            and type(temperature) is float and (temperature == 0.0 or MIN_TEMPERATURE <= temperature < math.inf)
            and type(self.top_k) is int and self.top_k >= 0
            and type(self.top_p) is float and 0.0 < self.top_p <= 1.0
            and type(self.min_p) is float and 0.0 <= self.min_p <= 1.0
            and type(self.repetition_penalty) is float and 0.0 < self.repetition_penalty < math.inf
            and type(self.presence_penalty) is float and -2.0 <= self.presence_penalty <= 2.0
            and type(self.frequency_penalty) is float and -2.0 <= self.frequency_penalty <= 2.0
            and (seed is None or type(seed) is int and 0 <= seed <= MAX_SEED - n + 1)
            and type(self.ignore_eos) is bool
            and type(self.stop) is list and not self.stop
            and type(self.stop_token_ids) is list and not self.stop_token_ids
            and type(self.logit_bias) is dict and not self.logit_bias
            and self.logprobs is None and self.prompt_logprobs is None
            and self.include_stop_str_in_output is False and self.skip_special_tokens is True
            and self.spaces_between_special_tokens is True and type(self.bad_words) is list and not self.bad_words
            and self.allowed_token_ids is None and self.truncate_prompt_tokens is None
            and type(self.bad_words_token_ids) is list and not self.bad_words_token_ids
            and self.structured is None
        )

    def _check(self) -> None:
        self.n = check_cap("samples", _count("n", self.n, 1, None), "n", RequestRejected)
        self.max_tokens = _count("max_tokens", self.max_tokens, 1, MAX_TOKENS_LIMIT)
        self.min_tokens = _count("min_tokens", self.min_tokens, 0, self.max_tokens)
        self.temperature = _real("temperature", self.temperature, low=0.0)
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        top_k = _count("top_k", self.top_k, -1, None)
        self.top_k = 0 if top_k == -1 else top_k  # vLLM spells "off" as -1 too
        self.top_p = _real("top_p", self.top_p, low=0.0, high=1.0)
        if self.top_p == 0.0:
            raise RequestRejected("top_p must be in (0, 1], got 0")
        self.min_p = _real("min_p", self.min_p, low=0.0, high=1.0)
        self.repetition_penalty = _real("repetition_penalty", self.repetition_penalty, low=0.0)
        if self.repetition_penalty == 0.0:
            raise RequestRejected("repetition_penalty must be > 0 (1 = off), got 0")
        self.presence_penalty = _real("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        self.frequency_penalty = _real("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if self.seed is not None:
            self.seed = _count("seed", self.seed, 0, MAX_SEED - (self.n - 1))  # sample i uses seed + i
        if not isinstance(self.ignore_eos, bool):
            raise RequestRejected(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _token_list("stop_token_ids", self.stop_token_ids)
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.logprobs is not None:
            self.logprobs = _count("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _count("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        for name in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise RequestRejected(f"{name} must be True or False, got {getattr(self, name)!r}")
        self.bad_words = _bad_words(self.bad_words)
        self.bad_words_token_ids = [ids for w in self.bad_words_token_ids or () if (ids := _token_list("bad_words", w))]
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_list("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise RequestRejected("allowed_token_ids must not be empty (leave it unset to allow every token)")
        if self.truncate_prompt_tokens is not None:
            value = _count("truncate_prompt_tokens", self.truncate_prompt_tokens, -1, None)
            if value == 0:
                raise RequestRejected("truncate_prompt_tokens must be >= 1 (or -1: the model's length), got 0")
            self.truncate_prompt_tokens = value
        self.structured = StructuredOutputs.of(self.structured)

    def checked_copy(self) -> SamplingParams:
        """A copy checked again (fields may have been edited since construction) that shares no container
        with this one, so the caller's later edits cannot reach a running request."""
        new = object.__new__(SamplingParams)
        new.__dict__.update(self.__dict__)
        new.__post_init__()
        new.stop, new.stop_token_ids, new.logit_bias = list(new.stop), list(new.stop_token_ids), dict(new.logit_bias)
        new.bad_words, new.bad_words_token_ids = list(new.bad_words), [list(w) for w in new.bad_words_token_ids]
        if new.allowed_token_ids is not None:
            new.allowed_token_ids = list(new.allowed_token_ids)
        return new

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named by the request must exist in the model (the engine calls this at ``add_request``)."""
        if not (self.stop_token_ids or self.logit_bias or self.allowed_token_ids):
            return
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias),
                          ("allowed_token_ids", self.allowed_token_ids or ())):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise RequestRejected(f"{name} has token id {bad[0]}, outside the vocabulary 0..{vocab_size - 1}")


def _count(name: str, value: Any, low: int, high: int | None) -> int:
    """An integer (``bool`` is not one here) in ``low..high``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestRejected(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        upper = "" if high is None else f"..{high}"
        raise RequestRejected(f"{name} must be in {low}{upper}{'' if upper else ' or more'}, got {value}")
    return int(value)


def _real(name: str, value: Any, low: float | None = None, high: float | None = None) -> float:
    """A finite number in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestRejected(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise RequestRejected(f"{name} must be a finite number, got {value}")
    if (low is not None and value < low) or (high is not None and value > high):
        span = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise RequestRejected(f"{name} must be {'in ' if high is not None else ''}{span}, got {value}")
    return value


def _token_id(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestRejected(f"{name} must hold non-negative integer token ids, got {value!r}")
    return int(value)


def _token_list(name: str, values: Any) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple, set, frozenset)):
        raise RequestRejected(f"{name} must be a list of token ids, got {values!r}")
    return [_token_id(name, v) for v in values]


def _stop_strings(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise RequestRejected(f"stop must be a string or a list of strings, got {stop!r}")
    if any(not s for s in stop):
        raise RequestRejected("stop strings must be non-empty")
    return list(stop)


def _bad_words(words: Any) -> list[str]:
    if words is None:
        return []
    if isinstance(words, str) or not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
        raise RequestRejected(f"bad_words must be a list of strings, got {words!r}")
    if any(not w.strip() for w in words):
        raise RequestRejected("bad_words must hold non-blank strings")
    return list(words)


def _logit_bias(bias: Any) -> dict[int, float]:
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise RequestRejected(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
    checked = {}
    for token, value in bias.items():
        value = _real("a logit_bias value", value, low=-MAX_LOGIT_BIAS, high=MAX_LOGIT_BIAS)
        checked[_token_id("logit_bias", token)] = value
    return checked
