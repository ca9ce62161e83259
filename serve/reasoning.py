"""Reasoning parsers (``--reasoning-parser``): the thinking part of an answer goes to ``reasoning_content``.

Both split at ``</think>``. ``deepseek_r1``: the template opens ``<think>`` in the prompt, so everything up
to ``</think>`` is reasoning (all of it while no ``</think>`` has come). ``qwen3``: reasoning only when the
answer opens with ``<think>`` (with ``enable_thinking: false`` the template closes it in the prompt, and
the answer is all content). Like the tool parsers, fed piece by piece (``feed`` gives the new
(reasoning, content) text, ``finish`` what was held): text that may start a tag is held back, and no piece
is scanned twice. ``start`` / ``end`` name the markers, so a constraint can wait for the reasoning's end.
"""

from __future__ import annotations

from pagedkv.serve.tool_parsers.base import Lead, TagScan

OPEN, CLOSE = "<think>", "</think>"


class _ThinkSplit:
    start, end = OPEN, CLOSE
    optional = False  # qwen3: without an opening <think> the answer is all content

    def __init__(self) -> None:
        self.lead = Lead(OPEN)
        self.close = TagScan(CLOSE)
        self.thinking: bool | None = None  # None until the opening is decided
        self.answer = False  # past </think>
        self.trim = True  # the content's leading newlines (after </think>) are dropped

    def feed(self, text: str) -> tuple[str, str]:
        if self.thinking is None:
            opened = self.lead.feed(text)
            if opened is None:
                return "", ""
            lead, text = opened
            self.thinking = not self.optional or lead.strip() == OPEN
            if not self.thinking:
                self.answer, self.trim = True, False  # no <think>: the whole answer is content
                return "", lead + text
        if self.answer:
            return "", self._content(text)
        reasoning, after = self.close.feed(text)
        if after is None:
            return reasoning, ""
        self.answer = True
        return reasoning, self._content(after)

    def _content(self, text: str) -> str:
        if self.trim:
            text = text.lstrip("\n")
            self.trim = not text
        return text

    def finish(self) -> tuple[str, str]:
        if self.thinking is None:
            held = self.lead.flush()
            self.thinking = not self.optional or held.strip() == OPEN
            return (held.strip().removeprefix(OPEN), "") if self.thinking else ("", held)
        return ("", "") if self.answer else (self.close.flush(), "")


class DeepSeekR1ReasoningParser(_ThinkSplit):
    pass


class Qwen3ReasoningParser(_ThinkSplit):
    optional = True
