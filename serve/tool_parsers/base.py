"""What a tool-call parser returns, and the JSON scanning the JSON-based formats share.

A parser is a pure function of the text so far: ``parse(text, final)`` gives the content that is surely
content and the calls seen, the last one possibly still being generated (``complete`` False, its
``arguments`` a prefix of the final JSON text). Streaming sends the difference between two parses, so a
parser only has to keep every answer a prefix of the next one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments (a prefix of it while incomplete)
    complete: bool = True


@dataclass
class Parsed:
    content: str
    calls: list[ToolCall] = field(default_factory=list)


class ToolParser(Protocol):
    def parse(self, text: str, final: bool) -> Parsed:
        """Content and calls in ``text``; with ``final`` the text is the whole output."""


_SCALAR = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")
_NAME = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def skip_space(text: str, pos: int, also: str = "") -> int:
    while pos < len(text) and (text[pos].isspace() or text[pos] in also):
        pos += 1
    return pos


def value_end(text: str, start: int) -> int | None:
    """Where the JSON value starting at ``start`` (after any whitespace) ends, or None if it is not complete."""
    i = skip_space(text, start)
    if i >= len(text):
        return None
    if text[i] in "{[\"":
        depth, in_string, escaped = 0, False, False
        for j in range(i, len(text)):
            ch = text[j]
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
                    if depth == 0:
                        return j + 1
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
        return None
    match = _SCALAR.match(text, i)
    return match.end() if match and match.end() < len(text) else None


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that starts ``tag`` (text held back while streaming)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def scan_call(text: str, start: int, final: bool) -> tuple[ToolCall | None, int | None]:
    """The ``{"name": ..., "arguments"|"parameters": {...}}`` object at ``start``: (its call, or None before its
    name is known; where the object ends, or None while incomplete). Arguments are the model's own JSON text."""
    end = value_end(text, start)
    segment = text[start:end] if end is not None else text[start:]
    name_match = _NAME.search(segment)
    if name_match is None:
        return None, end
    try:
        name = json.loads(name_match.group(1))
    except ValueError:
        return None, end
    args_match = _ARGS.search(segment)
    if args_match is None:
        return ToolCall(name, "{}" if end is not None else "", complete=end is not None), end
    args_start = start + args_match.end()
    args_end = value_end(text, args_start)
    if args_end is None:
        partial = text[args_start:]  # (a JSON string of JSON is decoded once whole: nothing of it streams before)
        return ToolCall(name, "" if partial.startswith('"') else partial, complete=False), end
    arguments = text[args_start:args_end]
    try:
        value = json.loads(arguments)
    except ValueError:
        return ToolCall(name, arguments, complete=False), end
    if isinstance(value, str):  # arguments sent as a JSON string of JSON
        arguments = value
    return ToolCall(name, arguments, complete=end is not None), end


def scan_call_list(text: str, pos: int, final: bool) -> list[ToolCall]:
    """The calls of a JSON array of call objects starting at ``pos`` (at its ``[``)."""
    calls: list[ToolCall] = []
    pos = skip_space(text, pos + 1, ",")
    while pos < len(text) and text[pos] == "{":
        call, end = scan_call(text, pos, final)
        if call is not None:
            calls.append(call)
        if end is None:
            break
        pos = skip_space(text, end, ",")
    return calls
