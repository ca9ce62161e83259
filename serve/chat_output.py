"""One chat choice's text as an OpenAI message: the reasoning split, then tool calls, whole or as deltas.

:class:`ChatShaper` holds the request's parsers (a reasoning parser, a tool parser: the server's for
``auto``, a forced one for ``required`` or a named function). :meth:`ChatShaper.message` shapes the final
text; a :class:`ChatDeltas` per streamed choice sends what each new parse adds: reasoning and content
text, new calls (id, name) and the new end of each call's arguments.
"""

from __future__ import annotations

import uuid
from typing import Any

from pagedkv.serve.tool_parsers.base import Parsed


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatShaper:
    def __init__(self, tool_parser: Any = None, reasoning_parser: Any = None) -> None:
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser

    def parse(self, text: str, final: bool) -> tuple[str | None, Parsed]:
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning, text = self.reasoning_parser.split(text, final)
        return reasoning, (self.tool_parser.parse(text, final) if self.tool_parser is not None else Parsed(text))

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """(the assistant message, whether it calls tools)."""
        reasoning, parsed = self.parse(text, final=True)
        content: str | None = parsed.content
        if parsed.calls and not parsed.content.strip():
            content = None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning_parser is not None:
            message["reasoning_content"] = reasoning
        if parsed.calls:
            message["tool_calls"] = [{"id": call_id(), "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]
        return message, bool(parsed.calls)


class ChatDeltas:
    """The streamed deltas of one choice; ``calls`` tells whether any tool call went out."""

    def __init__(self, shaper: ChatShaper) -> None:
        self.shaper = shaper
        self.reasoning_sent = 0
        self.content_sent = 0
        self.sent: list[list[str]] = []  # per call: [id, the arguments text sent so far]

    @property
    def calls(self) -> bool:
        return bool(self.sent)

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        reasoning, parsed = self.shaper.parse(text, final)
        delta: dict[str, Any] = {}
        if reasoning and len(reasoning) > self.reasoning_sent:
            delta["reasoning_content"] = reasoning[self.reasoning_sent:]
            self.reasoning_sent = len(reasoning)
        if len(parsed.content) > self.content_sent:
            delta["content"] = parsed.content[self.content_sent:]
            self.content_sent = len(parsed.content)
        calls = []
        for index, call in enumerate(parsed.calls):
            entry: dict[str, Any] | None = None
            if index == len(self.sent):
                self.sent.append([call_id(), ""])
                entry = {"index": index, "id": self.sent[index][0], "type": "function",
                         "function": {"name": call.name, "arguments": ""}}
            if index >= len(self.sent):
                break
            done = self.sent[index][1]
            if len(call.arguments) > len(done) and call.arguments.startswith(done):  # (never taken back)
                entry = entry or {"index": index, "function": {}}
                entry["function"]["arguments"] = call.arguments[len(done):]
                self.sent[index][1] = call.arguments
            if entry is not None:
                calls.append(entry)
        if calls:
            delta["tool_calls"] = calls
        return delta
