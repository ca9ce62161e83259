"""The telemetry wire format: newline-delimited JSON, one message per line.

Every message has ``v`` (the protocol version), ``seq`` and ``type``:

- ``hello``: what the stream is about (``num_blocks``, ``block_size``, ``num_cpu_blocks``,
  ``backend``, ``model``, ``device``);
- ``snapshot``: the full state at version ``seq`` (a keyframe): per-block ref
  counts, kept (cached) blocks, live requests with their block tables, stats;
- ``delta``: the events of one engine step, moving the state from ``seq - 1``
  to ``seq``, with that step's stats and ``progress`` (``[computed, generated]``
  of running requests);
- ``heartbeat``: sent by the server when idle; ``seq`` is the newest version;
- ``end``: the engine closed the stream.

``seq`` is the state version, not a line counter: a delta is applied only to
the state it follows; a reader that sees a gap waits for the next snapshot.
This module has no dependencies, so the engine and the monitor share it.

Version 3 drops version 2's ``request_decode`` event and the snapshot's ``decoding``
list (a simulator shortcut that had leaked into the stream): every running request's
progress is in every delta again, as in version 1. Older streams are still read.

The format is shared by the telemetry plugin (writing), the monitor (reading live or
from a trace) and the simulator (reading traces), so it sits in core.
"""

from __future__ import annotations

import json
from typing import Any

PROTOCOL_VERSION = 3
MESSAGE_TYPES = ("hello", "snapshot", "delta", "heartbeat", "end")


class ProtocolError(ValueError):
    """A line is not a valid telemetry message; the text says why."""


def encode(message: dict[str, Any]) -> bytes:
    """One message as one NDJSON line (compact, newline-terminated)."""
    return (json.dumps(message, separators=(",", ":")) + "\n").encode()


def message(kind: str, seq: int, t: float, **fields: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "seq": seq, "type": kind, "t": round(t, 4), **fields}


def _int(msg: dict, key: str, minimum: int = 0) -> int:
    value = msg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        kind = msg.get("type", "message")
        raise ProtocolError(f"{kind} field {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_blocks(msg: dict, key: str, value: int) -> None:
    """A reader builds a per-block table from ``hello``: refuse a count no engine could have (PAGEDKV_MAX_BLOCKS)."""
    from pagedkv.core.limits import check_cap

    try:
        check_cap("blocks", value, f"hello field {key!r}")
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None


def _list(msg: dict, key: str) -> list:
    value = msg.get(key)
    if not isinstance(value, list):
        raise ProtocolError(f"{msg.get('type')} field {key!r} must be a list, got {type(value).__name__}")
    return value


def validate(msg: Any) -> dict[str, Any]:
    """Check a decoded message's shape (not its meaning); return it or raise :class:`ProtocolError`."""
    if not isinstance(msg, dict):
        raise ProtocolError(f"a message must be a JSON object, got {type(msg).__name__}")
    version = msg.get("v")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ProtocolError(f"missing or invalid protocol version 'v': {version!r}")
    if version > PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version} is newer than this reader (version {PROTOCOL_VERSION})")
    kind = msg.get("type")
    if kind not in MESSAGE_TYPES:
        raise ProtocolError(f"unknown message type {kind!r}; expected one of {', '.join(MESSAGE_TYPES)}")
    _int(msg, "seq")
    t = msg.get("t", 0.0)
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        raise ProtocolError(f"{kind} field 't' must be a number, got {t!r}")
    if kind == "hello":
        for key in ("num_blocks", "num_cpu_blocks"):
            if key == "num_blocks" or key in msg:
                _check_blocks(msg, key, _int(msg, key, 1 if key == "num_blocks" else 0))
        _int(msg, "block_size", 1)
    elif kind == "snapshot":
        _int(msg, "step")
        refs = _list(msg, "refs")
        if not refs or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in refs):
            raise ProtocolError("snapshot field 'refs' must be a non-empty list of integers >= 0")
        for b in _list(msg, "kept"):
            if not isinstance(b, int) or not 0 <= b < len(refs):
                raise ProtocolError(f"snapshot kept block {b!r} is out of range 0..{len(refs) - 1}")
        for req in _list(msg, "requests"):
            _check_request(req, len(refs))
        if not isinstance(msg.get("stats", {}), dict):
            raise ProtocolError("snapshot field 'stats' must be an object")
    elif kind == "delta":
        _int(msg, "step")
        for ev in _list(msg, "events"):
            if not (isinstance(ev, list) and len(ev) == 2 and isinstance(ev[0], str) and isinstance(ev[1], dict)):
                raise ProtocolError(f"a delta event must be [kind, {{data}}], got {ev!r:.80}")
        if not isinstance(msg.get("stats", {}), dict):
            raise ProtocolError("delta field 'stats' must be an object")
        if not isinstance(msg.get("progress", {}), dict):
            raise ProtocolError("delta field 'progress' must be an object")
    return msg


def _check_request(req: Any, num_blocks: int) -> None:
    if not isinstance(req, dict) or not isinstance(req.get("id"), str):
        raise ProtocolError(f"a snapshot request must be an object with a string 'id', got {req!r:.80}")
    blocks = req.get("blocks", [])
    if not isinstance(blocks, list) or not all(isinstance(b, int) and 0 <= b < num_blocks for b in blocks):
        raise ProtocolError(f"request {req['id']!r}: 'blocks' must list block ids in 0..{num_blocks - 1}")


def decode(line: str | bytes) -> dict[str, Any]:
    """Decode and check one line; raise :class:`ProtocolError` (without a line number)."""
    if isinstance(line, bytes):
        try:
            line = line.decode()
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    text = line.strip()
    if not text:
        raise ProtocolError("empty line")
    try:
        msg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProtocolError(f"not valid JSON: {exc.msg} at column {exc.colno}") from None
    except RecursionError:
        raise ProtocolError("the JSON is nested too deeply") from None
    except ValueError as exc:  # int() refuses a number of more than 4300 digits
        raise ProtocolError(f"not valid JSON: {str(exc).split(';')[0]}") from None
    return validate(msg)
