"""Mistral format: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` objects, or (tokenizer
v11+) ``[TOOL_CALLS]name[ARGS]{...}`` per call; the text around them is content. After the tag a short
head (a name, ``[ARGS]``) is read a character at a time, then the JSON value is scanned once."""

from __future__ import annotations

import re

from pagedkv.serve.tool_parsers.base import Candidate, Held, JsonScan, Piece, TagScan, candidate_of

TAG = "[TOOL_CALLS]"
_HEAD = re.compile(r"\s*([A-Za-z0-9_.\-]{1,128})\s*(?:\[ARGS\])?\s*")
_MAYBE_HEAD = re.compile(r"\s*[A-Za-z0-9_.\-]{0,128}\s*(?:\[A?R?G?S?\]?)?\s*")  # (may be a head, once complete)
OUT, HEAD, VALUE = range(3)


class MistralToolParser:
    def __init__(self) -> None:
        self.state = OUT
        self.tag = TagScan(TAG)
        self.head = ""
        self.name: str | None = None  # the v11 call's name (None: an array of calls)
        self.value, self.scan = Held(), JsonScan()

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        while text:
            if self.state == OUT:
                before, after = self.tag.feed(text)
                if before:
                    out.append(before)
                if after is None:
                    break
                self.state, self.head, text = HEAD, "", after
            elif self.state == HEAD:
                text = self._read_head(text, out)
            else:
                end = self.scan.feed(text)
                self.value.add(text if end is None else text[:end])
                if end is None:
                    break
                value = self.value.text()
                raw = TAG + self.head + value
                if self.name is None:
                    out.append(candidate_of(raw, value, array=True))
                else:
                    out.append(Candidate(raw, [(self.name, value)]))
                self.state, text = OUT, text[end:]
        return out

    def _read_head(self, text: str, out: list[Piece]) -> str:
        """Reads the head up to the value's first bracket; what cannot be a head goes out as content."""
        for i, ch in enumerate(text):
            if ch == "[" and not self.head.strip():
                self.name = None
            elif ch == "{" and (match := _HEAD.fullmatch(self.head)) is not None:
                self.name = match.group(1)
            else:
                self.head += ch
                if _MAYBE_HEAD.fullmatch(self.head) is None:
                    out.append(TAG + self.head)
                    self.state = OUT
                    return text[i + 1:]
                continue
            self.state, self.value, self.scan = VALUE, Held(), JsonScan()
            return text[i:]
        return ""

    def finish(self) -> list[Piece]:
        if self.state == OUT:
            held = self.tag.flush()
        else:
            held = TAG + self.head + (self.value.text() if self.state == VALUE else "")
        return [held] if held else []
