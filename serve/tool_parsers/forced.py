"""The outputs of a forced ``tool_choice``, which a grammar made well-formed: a named function's arguments
(the whole text), or for ``required`` a JSON array of ``{"name", "parameters"}`` calls. Judged like any
other call: an answer cut short (``length``) is content, not a call."""

from __future__ import annotations

from pagedkv.serve.tool_parsers.base import Candidate, Held, JsonScan, Lead, Piece, candidate_of


class NamedToolParser:
    def __init__(self, name: str) -> None:
        self.name = name
        self.text = Held()

    def feed(self, text: str) -> list[Piece]:
        self.text.add(text)  # the whole answer is one call: judged at its end
        return []

    def finish(self) -> list[Piece]:
        text = self.text.text()
        return [Candidate(text, [(self.name, text)])] if text.strip() else ([text] if text else [])


class RequiredToolParser:
    def __init__(self) -> None:
        self.lead = Lead("")
        self.value: Held | None = None
        self.scan = JsonScan()
        self.rest = False  # past the array: all content

    def feed(self, text: str) -> list[Piece]:
        if self.rest:
            return [text]
        if self.value is None:
            opened = self.lead.feed(text)
            if opened is None:
                return []
            lead, text = opened
            if text[0] != "[":
                self.rest = True
                return [lead + text]
            self.value = Held(lead)
        end = self.scan.feed(text)
        self.value.add(text if end is None else text[:end])
        if end is None:
            return []
        self.rest, value = True, self.value.text()
        out: list[Piece] = [candidate_of(value, value, array=True)]
        return out + ([text[end:]] if text[end:] else [])

    def finish(self) -> list[Piece]:
        held = self.lead.flush() if self.value is None else ("" if self.rest else self.value.text())
        return [held] if held else []
