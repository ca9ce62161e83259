"""The sampling fields' rules: stop strings, penalties, bias and logprobs -> ``SamplingParams`` keyword arguments.

``GenerationRequest`` (``generation.py``) calls these; each bad value is an ``InvalidField`` naming
its field. Every list a client controls has a cap, so no single request can make every step do
unbounded work (the caps are documented in docs/exposed.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pagedkv.core.sample.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS
from pagedkv.serve.api.errors import InvalidField

MAX_STOP_STRINGS = 16  # OpenAI allows 4; every stop string is checked against every new token's text
MAX_STOP_CHARS = 256  # per stop string: held back while streaming and scanned each step
MAX_LOGIT_BIAS_ENTRIES = 1024
# when a request leaves a field unset and the model's generation config (--generation-config) has no
# value for it: OpenAI's / vLLM's
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def stop_strings(value: Any) -> list[str]:
    """``stop`` (a string or a list of them) as a list: non-empty, at most MAX_STOP_STRINGS of MAX_STOP_CHARS.

    Raises ``ValueError``: it runs as a field validator, and pydantic names the field.
    """
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("stop must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed")
    if any(not s for s in stops):
        raise ValueError("stop strings must be non-empty")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ValueError(f"each stop string may have at most {MAX_STOP_CHARS} characters")
    return list(stops)


def sampling_extras(body: Mapping[str, Any], chat: bool, vocab_size: int | None = None) -> dict[str, Any]:
    """The penalty, bias and logprob fields of ``body`` as ``SamplingParams`` kwargs (absent/None: left out).

    Completions take ``logprobs: k``; chat takes ``logprobs: true`` with ``top_logprobs: k`` (OpenAI's
    two shapes). ``logit_bias`` keys are token ids written as strings, as OpenAI sends them.
    """
    kwargs: dict[str, Any] = {}
    for name, low, high in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                            ("min_p", 0.0, 1.0)):
        if body.get(name) is not None:
            kwargs[name] = _real(name, body[name], low, high)
    if body.get("repetition_penalty") is not None:
        value = _real("repetition_penalty", body["repetition_penalty"], 0.0, math.inf)
        if value == 0.0:
            raise InvalidField("repetition_penalty", "repetition_penalty must be > 0 (1 = off), got 0")
        kwargs["repetition_penalty"] = value
    if body.get("logit_bias") is not None:
        kwargs["logit_bias"] = logit_bias(body["logit_bias"], vocab_size)
    if chat:
        wants, top = body.get("logprobs"), body.get("top_logprobs")
        if wants is not None and not isinstance(wants, bool):
            raise InvalidField("logprobs", f"logprobs must be true or false for chat, got {wants!r}")
        if top is not None:
            top = _count("top_logprobs", top, 0, MAX_LOGPROBS)
            if top and not wants:
                raise InvalidField("top_logprobs", "top_logprobs needs logprobs: true")
        if wants:
            kwargs["logprobs"] = top or 0
    elif body.get("logprobs") is not None:
        kwargs["logprobs"] = _count("logprobs", body["logprobs"], 0, MAX_LOGPROBS)
    if body.get("prompt_logprobs") is not None:
        kwargs["prompt_logprobs"] = _count("prompt_logprobs", body["prompt_logprobs"], 0, MAX_LOGPROBS)
    return kwargs


def logit_bias(bias: Any, vocab_size: int | None) -> dict[int, float]:
    """``{"token id": bias}`` -> ``{id: bias}``; ids must be decimal, inside the vocabulary, biases in +-100."""
    if not isinstance(bias, Mapping):
        raise InvalidField("logit_bias", f"logit_bias must be an object of token id -> bias, got {bias!r}")
    checked: dict[int, float] = {}
    for key, value in bias.items():
        token = _token_id(key)
        if vocab_size is not None and token >= vocab_size:
            raise InvalidField("logit_bias", f"logit_bias names token {token}, outside the vocabulary "
                                           f"0..{vocab_size - 1}")
        checked[token] = _real("logit_bias", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    return checked


def _token_id(key: Any) -> int:
    if isinstance(key, int) and not isinstance(key, bool):
        token = key
    elif isinstance(key, str) and key.strip().isascii() and key.strip().isdecimal():
        if len(key.strip()) > 18:  # int() of thousands of digits is slow, and no vocabulary is that big
            raise InvalidField("logit_bias", f"logit_bias names token {key.strip()[:20]}..., outside any vocabulary")
        token = int(key.strip())
    else:
        raise InvalidField("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
    if token < 0:
        raise InvalidField("logit_bias", f"logit_bias keys must be non-negative token ids, got {key!r}")
    return token


def _real(name: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidField(name, f"{name} must be a finite number, got {value!r}")
    if not low <= value <= high:
        span = f"[{low:g}, {high:g}]" if math.isfinite(high) else f"> {low:g}"
        raise InvalidField(name, f"{name} must be in {span}, got {value!r}")
    return float(value)


def _count(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidField(name, f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise InvalidField(name, f"{name} must be in {low}..{high}, got {value}")
    return value
