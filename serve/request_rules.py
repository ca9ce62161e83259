"""Rules both front ends (``engine serve`` and ``engine run --input``) apply to a request body, in plain Python.

The server's pydantic models and the batch-file reader call these, so a body means the same
thing, and is refused for the same reason, in both. Every list a client controls has a cap,
so no single request can make every step (or the tokenizer) do unbounded work; the caps are
documented in docs/exposed.md.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagedkv.serve.api.errors import InvalidField

DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # --max-request-bytes
MAX_STOP_STRINGS = 16  # OpenAI allows 4; every stop string is checked against every new token's text
MAX_STOP_CHARS = 256  # per stop string: held back while streaming and scanned each step
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_PROMPTS = 256  # prompts in one completions request (each runs as its own engine request)
MAX_MESSAGES = 1024  # chat messages in one request
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
MIN_CHARS_PER_TOKEN_BOUND = 32  # see max_prompt_chars

_SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; invalid UTF-8, bad JSON, huge integers and lone surrogates raise InvalidField."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise InvalidField(None, "the body is nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise InvalidField(None, f"the body is not valid UTF-8 (byte {exc.start})") from None
    except ValueError as exc:  # JSONDecodeError, and int() refusing more than 4300 digits
        message = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc).split(";")[0]
        raise InvalidField(None, f"the body is not valid JSON: {message}") from None
    if not isinstance(data, dict):
        raise InvalidField(None, f"the body must be a JSON object, not {type(data).__name__}")
    if _SURROGATE_ESCAPE.search(raw):  # only an escape can smuggle a lone surrogate through json.loads
        where = lone_surrogate_path(data)
        if where is not None:
            raise InvalidField(where, f"{where}: contains a lone UTF-16 surrogate, which is not text")
    return data


def lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string (key or value) in ``value`` that is not encodable text, or None."""
    if isinstance(value, str):
        return None if _encodes(value) else path or "body"
    if isinstance(value, dict):
        for key, item in value.items():
            here = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and not _encodes(key):
                return path or "body"
            if (found := lone_surrogate_path(item, here)) is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if (found := lone_surrogate_path(item, f"{path}.{index}")) is not None:
                return found
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def stop_strings(value: Any) -> list[str]:
    """``stop`` (a string or a list of them) as a list: non-empty, at most MAX_STOP_STRINGS of MAX_STOP_CHARS."""
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidField("stop", "stop must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidField("stop", f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed")
    if any(not s for s in stops):
        raise InvalidField("stop", "stop strings must be non-empty")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise InvalidField("stop", f"each stop string may have at most {MAX_STOP_CHARS} characters")
    return list(stops)


def check_role(role: Any) -> str:
    if role not in CHAT_ROLES:
        raise InvalidField("role", f"role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
    return role


def content_text(content: Any) -> str:
    """A message's text: a string, null, or a list of ``{"type": "text", "text": ...}`` parts (nothing else)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidField("content", "content must be a string or a list of text parts")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidField("content", "only text content parts ({'type': 'text', 'text': ...}) are supported")
        if extra := sorted(set(part) - {"type", "text"}):
            raise InvalidField("content", f"unknown field(s) in a text part: {', '.join(extra)}")
        parts.append(part["text"])
    return "".join(parts)


def count_cap(param: str, items: Any, limit: int, what: str) -> None:
    if len(items) > limit:
        raise InvalidField(param, f"{param} has {len(items)} {what}; at most {limit} are allowed")


def max_prompt_chars(max_model_len: int, tokenizer: Any) -> int:
    """Characters above which a text cannot fit in ``max_model_len`` tokens, whatever it says.

    A token spells at most as many characters as its longest vocabulary entry (at least
    MIN_CHARS_PER_TOKEN_BOUND, for normalizers and byte-level spellings), so a longer text is
    refused before the tokenizer spends seconds on it.
    """
    longest = MIN_CHARS_PER_TOKEN_BOUND
    try:
        longest = max(longest, max(map(len, tokenizer.get_vocab())))
    except Exception:  # noqa: BLE001 - no vocabulary to read: the floor holds
        pass
    return max_model_len * longest
