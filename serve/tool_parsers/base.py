"""What a tool-call parser returns, and the incremental scanning the built-in formats share.

A parser is fed an answer piece by piece (``feed(text)``, then ``finish()`` at its end) and returns, in
order, what each piece settled: plain strings (content) and :class:`Candidate` calls (the raw text of a
call block and what it names). It holds back only the text still undecided, and each piece costs work in
proportion to its own length, so a long answer is never re-scanned per step. Every decision depends only
on the characters, never on where the pieces were cut, so a streamed answer parses exactly as the whole.

The shaper (``chat_output``) then keeps a candidate as calls only if every call names a declared tool
and its arguments are a strict JSON object (no NaN/Infinity, nesting under ``MAX_DEPTH``); otherwise its
raw text is content. A parser never has to judge that itself, and nothing it cannot parse is lost.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

MAX_DEPTH = 100  # deeper arguments are content: far past any real schema, far below Python's recursion limit


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    complete: bool = True


@dataclass
class Parsed:
    """What a whole-text parser (the older ``parse(text, final)`` plugin API) returns."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)


@dataclass
class Candidate:
    """A block of the answer that looks like calls: ``raw`` is its text (content if it is refused); ``calls``
    are (name, arguments as a JSON text or a value) pairs, None if the block did not parse; ``kept`` is
    content that goes out beside the calls when they are accepted."""

    raw: str
    calls: list[tuple[Any, Any]] | None
    kept: str = ""


Piece = str | Candidate


class ToolParser(Protocol):
    def feed(self, text: str) -> list[Piece]:
        """The next piece of the answer; returns what it settled (content strings and candidates), in order."""

    def finish(self) -> list[Piece]:
        """The answer ended: everything still held (an unfinished call is content)."""


class InvalidJson(ValueError):
    pass


def _no_constant(name: str) -> Any:
    raise InvalidJson(f"{name} is not JSON")


_DEPTH_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def strict_json(text: str) -> Any:
    """``json.loads`` of standard JSON only (no NaN / Infinity), at most ``MAX_DEPTH`` deep; raises ``ValueError``."""
    depth = 0
    for match in _DEPTH_TOKENS.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise InvalidJson(f"nested deeper than {MAX_DEPTH}")
        elif token in "]}":
            depth -= 1
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise InvalidJson("nested too deep") from None


def call_of(value: Any) -> tuple[Any, Any] | None:
    """(name, arguments) of a ``{"name": ..., "arguments"|"parameters": ...}`` object, else None."""
    if not isinstance(value, dict) or "name" not in value:
        return None
    for key in ("arguments", "parameters"):
        if key in value:
            return value["name"], value[key]
    return None


def candidate_of(raw: str, value_text: str, array: bool) -> Candidate:
    """The candidate of a JSON call object (or, with ``array``, a non-empty array of them) spelt ``value_text``."""
    try:
        value = strict_json(value_text)
    except ValueError:
        return Candidate(raw, None)
    items = value if array and isinstance(value, list) else [value] if not array else []
    calls = [call_of(item) for item in items]
    if not calls or any(c is None for c in calls):
        return Candidate(raw, None)
    return Candidate(raw, calls)  # type: ignore[arg-type]


def checked_calls(candidate: Candidate, names: frozenset[str]) -> list[ToolCall] | None:
    """The candidate's calls if every one names a declared tool with a strict JSON object of arguments."""
    if not candidate.calls:
        return None
    calls = []
    for name, arguments in candidate.calls:
        if not isinstance(name, str) or name not in names:
            return None
        try:
            if isinstance(arguments, str):  # the arguments as text (or a JSON string of JSON)
                arguments = strict_json(arguments)
            if not isinstance(arguments, dict):
                return None
            text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        except (ValueError, TypeError, RecursionError):  # sets, bytes, NaN, too deep: not JSON arguments
            return None
        calls.append(ToolCall(name, text))
    return calls


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that starts ``tag`` (text held back while streaming)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class TagScan:
    """Finds ``tag`` in text fed piece by piece; holds back only an end that may start it."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """(the text surely before the tag, the text after it, or None while the tag has not come)."""
        text = self.held + text
        found = text.find(self.tag)
        if found >= 0:
            self.held = ""
            return text[:found], text[found + len(self.tag):]
        keep = partial_suffix(text, self.tag)
        self.held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], None

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


class Lead:
    """The opening of an answer: whitespace and an optional ``tag`` (held), then its first real character.
    Whitespace is kept in pieces, so a model that writes nothing but spaces costs linear time."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.lead = Held()  # the whitespace and tag read so far
        self.partial = ""  # what may be the start of the tag
        self.stage = 0  # 0: leading whitespace, 1: maybe the tag, 2: whitespace after the tag

    def feed(self, text: str) -> tuple[str, str] | None:
        """None while undecided; else (the lead: whitespace and tag, the rest from its first character)."""
        if self.stage != 1:
            body = text.lstrip()
            self.lead.add(text[: len(text) - len(body)])
            if not body:
                return None
            if self.stage == 2:
                return self._opened(body)
            text, self.stage = body, 1
        probe = self.partial + text
        if self.tag and probe.startswith(self.tag):
            self.lead.add(self.tag)
            self.partial, self.stage = "", 2
            return self.feed(probe[len(self.tag):]) if len(probe) > len(self.tag) else None
        if self.tag.startswith(probe):
            self.partial = probe
            return None
        self.partial = ""
        return self._opened(probe)

    def _opened(self, rest: str) -> tuple[str, str]:
        lead, self.lead = self.lead.text(), Held()
        return lead, rest

    def flush(self) -> str:
        held, self.partial = self.lead.text() + self.partial, ""
        self.lead = Held()
        return held


_JSON_STOP = re.compile(r'["{}\[\]]')
_STRING_STOP = re.compile(r'["\\]')


class JsonScan:
    """Finds where a JSON object or array ends, fed piece by piece (its first piece starts at ``{`` or ``[``).
    Only brackets and strings are tracked; whether the text is valid JSON is decided once, at its end."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> int | None:
        """The index in ``text`` just past the value's end, or None if it goes on."""
        i, n = 0, len(text)
        while i < n:
            if self.escaped:
                self.escaped, i = False, i + 1
                continue
            if self.in_string:
                match = _STRING_STOP.search(text, i)
                if match is None:
                    return None
                i = match.end()
                if match.group() == "\\":
                    self.escaped = True
                else:
                    self.in_string = False
                continue
            match = _JSON_STOP.search(text, i)
            if match is None:
                return None
            i, ch = match.end(), match.group()
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth <= 0:
                    return i
        return None


class Held:
    """Text kept in pieces (joined once, when decided): appending is O(piece), not O(all held)."""

    def __init__(self, *parts: str) -> None:
        self.parts = [p for p in parts if p]

    def add(self, text: str) -> None:
        if text:
            self.parts.append(text)

    def text(self) -> str:
        return "".join(self.parts)
