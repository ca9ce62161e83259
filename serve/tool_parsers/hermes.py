"""Hermes / Qwen format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them;
the text around the blocks is content. A block is held from its opening tag to its closing one, then
judged whole: one find per piece, never a re-scan of the answer."""

from __future__ import annotations

from pagedkv.serve.tool_parsers.base import Candidate, Held, Piece, TagScan, candidate_of

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser:
    def __init__(self) -> None:
        self.open, self.close = TagScan(OPEN), TagScan(CLOSE)
        self.body: Held | None = None  # the open block's text (None: outside a block)

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        while text:
            if self.body is None:
                before, after = self.open.feed(text)
                if before:
                    out.append(before)
                if after is None:
                    break
                self.body, text = Held(), after
            else:
                before, after = self.close.feed(text)
                self.body.add(before)
                if after is None:
                    break
                body = self.body.text()
                out.append(candidate_of(OPEN + body + CLOSE, body, array=False))
                self.body, text = None, after
        return out

    def finish(self) -> list[Piece]:
        if self.body is None:
            held = self.open.flush()
            return [held] if held else []
        return [Candidate(OPEN + self.body.text() + self.close.flush(), None)]  # an unclosed block is content
