"""Pythonic format (Llama 3.2 / 4): the answer is a Python list of calls, ``[get_weather(city="Paris"), f()]``,
keyword arguments as literals, optionally inside ``<|python_start|>`` ... ``<|python_end|>``. The list is
found with a bracket scan as it arrives and read with ``ast`` once, when it closes; a list that is not all
calls, or whose values are not JSON (a set, bytes, ``1e999``), is content, and so is any other answer."""

from __future__ import annotations

import ast
import re

from pagedkv.serve.tool_parsers.base import MAX_DEPTH, Candidate, Held, Lead, Piece

WRAP = ("<|python_start|>", "<|python_end|>")
_STOP = re.compile(r"[\"'()\[\]{}]")
START, LIST, AFTER, CONTENT = range(4)


class _PythonScan:
    """Where a bracketed Python expression ends (strings in either quote, with escapes, are skipped)."""

    def __init__(self) -> None:
        self.depth = self.deepest = 0
        self.quote = ""
        self.escaped = False

    def feed(self, text: str) -> int | None:
        i = 0
        while i < len(text):
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif text[i] == "\\":
                    self.escaped = True
                elif text[i] == self.quote:
                    self.quote = ""
                i += 1
                continue
            match = _STOP.search(text, i)
            if match is None:
                return None
            i, ch = match.end(), match.group()
            if ch in "\"'":
                self.quote = ch
            elif ch in "([{":
                self.depth += 1
                self.deepest = max(self.deepest, self.depth)
            else:
                self.depth -= 1
                if self.depth <= 0:
                    return i
        return None


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _name(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _calls(source: str) -> list[tuple[str, dict]] | None:
    try:
        tree = ast.parse(source, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            name = _name(node.func) if isinstance(node, ast.Call) else None
            if name is None or node.args or any(k.arg is None for k in node.keywords):
                return None
            calls.append((name, {k.arg: ast.literal_eval(k.value) for k in node.keywords}))
        return calls
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):  # not a list of literal calls
        return None


class PythonicToolParser:
    def __init__(self) -> None:
        self.state = START
        self.lead = Lead(WRAP[0])
        self.source = Held()
        self.scan = _PythonScan()
        self.after = Lead(WRAP[1])  # after the closed list: whitespace, maybe the end tag

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        while text:
            if self.state == START:
                opened = self.lead.feed(text)
                if opened is None:
                    break
                lead, text = opened
                self.state = LIST if text[0] == "[" else CONTENT
                self.source = Held(lead)
                if self.state == CONTENT:
                    out.append(lead)
            elif self.state == LIST:
                end = self.scan.feed(text)
                self.source.add(text if end is None else text[:end])
                if end is None:
                    break
                self.state, text = AFTER, text[end:]
            elif self.state == AFTER:
                text = self._after(text, out)
            else:
                out.append(text)
                break
        return out

    def _candidate(self, end_tag: str) -> Candidate:
        raw = self.source.text()
        calls = _calls(raw.strip().removeprefix(WRAP[0]).strip()) if self.scan.deepest <= MAX_DEPTH else None
        return Candidate(raw + end_tag, calls)  # type: ignore[arg-type]

    def _after(self, text: str, out: list[Piece]) -> str:
        """After the list: whitespace and ``<|python_end|>`` belong to it; anything else is content."""
        opened = self.after.feed(text)
        if opened is None:
            return ""
        lead, rest = opened
        self.state = CONTENT
        if lead.strip() == WRAP[1]:
            out.append(self._candidate(lead))
            return rest
        out.append(self._candidate(""))
        return lead + rest

    def finish(self) -> list[Piece]:
        if self.state == AFTER:
            held = self.after.flush()
            if held.strip() == WRAP[1]:
                return [self._candidate(held)]
            return [self._candidate(""), *([held] if held else [])]
        held = {START: self.lead.flush, LIST: self.source.text}.get(self.state, str)()
        return [held] if held else []
