"""A request body's bytes -> a JSON object, refusing what is not text or not JSON, as both front ends read it.

``engine serve`` reads each HTTP body here and ``engine run --input`` each batch line, before the
endpoint's model sees it: invalid UTF-8, bad JSON, integers of thousands of digits and lone UTF-16
surrogates (which ``json.loads`` lets through as escapes) are one :class:`InvalidField` each.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagedkv.serve.api.errors import InvalidField

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
