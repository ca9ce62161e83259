"""A big answer as JSON bytes in many short encoder calls, so no single call holds the GIL for long.

``json.dumps`` runs in C and keeps the GIL for the whole call: a 115 MB answer (``n=64`` with
``top_logprobs`` 20) held every other thread, the event loop included, for about a second even
when encoded on a worker thread. Here the few top levels of the answer (body, choices, a choice,
its logprobs) are walked in Python, and any list longer than ``SPLIT`` items (a choice's per-token
entries, prompt logprobs, token ids) is encoded item by item or in slices, so each C call covers
one token's entry or a few thousand numbers; between calls the interpreter can switch threads.
The bytes are the same as Starlette's ``JSONResponse`` would send (compact, UTF-8, no NaN).
"""

from __future__ import annotations

import json
from typing import Any

SPLIT = 64  # a list longer than this is encoded in pieces
SCALAR_SLICE = 4096  # numbers / strings per encoder call in a long list of them
WALK_DEPTH = 4  # body > choices > choice > logprobs: always walked (each is small, what it holds may not be)

_encode = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


def encode_json(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON (Starlette's JSONResponse bytes), encoded piece by piece."""
    return "".join(_pieces(value, 0)).encode("utf-8")


def _pieces(value: Any, depth: int) -> list[str]:
    if isinstance(value, dict) and (depth < WALK_DEPTH or len(value) > SPLIT):
        out = ["{"]
        for i, (key, item) in enumerate(value.items()):
            out.append(("," if i else "") + _encode(str(key)) + ":")
            out.extend(_pieces(item, depth + 1))
        out.append("}")
        return out
    if isinstance(value, list) and (depth < WALK_DEPTH or len(value) > SPLIT):
        if value and not isinstance(value[0], (dict, list)):  # numbers or strings: a few thousand per call
            parts = [_encode(value[i:i + SCALAR_SLICE])[1:-1] for i in range(0, len(value), SCALAR_SLICE)]
            return ["[", ",".join(parts), "]"]
        out = ["["]
        for i, item in enumerate(value):
            if i:
                out.append(",")
            out.extend(_pieces(item, depth + 1))
        out.append("]")
        return out
    return [_encode(value)]
