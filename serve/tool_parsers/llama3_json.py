"""Llama 3.x JSON format: the answer is ``{"name": ..., "parameters": {...}}`` (optionally after
``<|python_tag|>``, several separated by ``;``). An answer that opens otherwise is content, and so is
whatever follows the calls; each object is scanned once, as it arrives."""

from __future__ import annotations

import re

from pagedkv.serve.tool_parsers.base import Held, JsonScan, Lead, Piece, candidate_of

TAG = "<|python_tag|>"
_SEPARATORS = re.compile(r"[\s;]*")
START, VALUE, BETWEEN, CONTENT = range(4)


class Llama3JsonToolParser:
    def __init__(self) -> None:
        self.state = START
        self.lead = Lead(TAG)
        self.raw = Held()  # the current object, with the lead or separators before it
        self.value = Held()  # the current object alone
        self.scan = JsonScan()
        self.between = Held()  # separators after a call (whitespace, ';')

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        while text:
            if self.state == START:
                opened = self.lead.feed(text)
                if opened is None:
                    break
                lead, text = opened
                self._begin(lead, text, out)
            elif self.state == BETWEEN:
                cut = _SEPARATORS.match(text).end()
                self.between.add(text[:cut])
                if cut == len(text):
                    break
                lead, self.between, text = self.between.text(), Held(), text[cut:]
                self._begin(lead, text, out)
            elif self.state == VALUE:
                end = self.scan.feed(text)
                piece = text if end is None else text[:end]
                self.raw.add(piece)
                self.value.add(piece)
                if end is None:
                    break
                out.append(candidate_of(self.raw.text(), self.value.text(), array=False))
                self.state, text = BETWEEN, text[end:]
            else:
                out.append(text)
                break
        return out

    def _begin(self, lead: str, text: str, out: list[Piece]) -> None:
        if text[0] == "{":
            self.state, self.raw, self.value, self.scan = VALUE, Held(lead), Held(), JsonScan()
        else:
            self.state = CONTENT
            if lead:
                out.append(lead)

    def finish(self) -> list[Piece]:
        held = self.lead.flush() + self.between.text() if self.state in (START, BETWEEN) else ""
        if self.state == VALUE:
            held = self.raw.text()
        return [held] if held else []
