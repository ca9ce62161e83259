"""One chat choice's text as an OpenAI message: the reasoning split, then tool calls, whole or as deltas.

:class:`ChatShaper` holds how a request's answers are parsed (a reasoning parser's and a tool parser's
factories: the server's for ``auto``, a forced one for ``required`` or a named function) and the names of
the declared tools. Each choice gets its own parsers (:class:`ChoiceParse`), fed only the new text of each
step. :meth:`ChatShaper.message` feeds a whole answer at once; :class:`ChatDeltas` feeds a stream and
sends what each piece settled. Both go through the same parsers and the same checks, so a streamed answer
adds up to the non-streamed one: a call goes out only whole, naming a declared tool with a strict JSON
object of arguments, and everything else is content. A parser that raises is a bug of its own: it is
logged, and the rest of that answer is content.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from pagedkv.serve.tool_parsers.base import Candidate, Parsed, Piece, ToolCall, checked_calls

log = logging.getLogger("pagedkv.serve")


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _WholeText:
    """A parser of the older whole-text API (``parse(text, final)`` / ``split(text, final)``), called once,
    on the whole answer: nothing of it streams before the end, but no text is parsed twice."""

    def __init__(self, parser: Any) -> None:
        self.parser = parser
        self.parts: list[str] = []
        self.thinking = True

    def feed(self, text: str) -> Any:
        self.parts.append(text)
        return ("", "") if hasattr(self.parser, "split") else []

    def finish(self) -> Any:
        text = "".join(self.parts)
        if hasattr(self.parser, "split"):
            reasoning, content = self.parser.split(text, True)
            self.thinking = reasoning is not None
            return reasoning or "", content
        parsed: Parsed = self.parser.parse(text, True)
        if not parsed.calls:
            return [parsed.content]
        return [Candidate(text, [(c.name, c.arguments) for c in parsed.calls], kept=parsed.content)]


def _incremental(parser: Any) -> Any:
    return parser if hasattr(parser, "feed") else _WholeText(parser)


class ChatShaper:
    def __init__(self, tool_factory: Callable[[], Any] | None = None,
                 reasoning_factory: Callable[[], Any] | None = None, tools: Iterable[str] = (),
                 reasoning_done: bool = False) -> None:
        self.tool_factory = tool_factory
        self.reasoning_factory = reasoning_factory
        self.names = frozenset(tools)  # the declared tools: a call to any other is content
        self.reasoning_done = reasoning_done  # the prompt closed the reasoning: the answer is all content

    def without_reasoning(self) -> ChatShaper:
        return ChatShaper(self.tool_factory, self.reasoning_factory, self.names, reasoning_done=True)

    def choice(self) -> ChoiceParse:
        return ChoiceParse(self)

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """(the assistant message, whether it calls tools) of a whole answer."""
        parse = self.choice()
        reasoning, content, calls = parse.feed(text, final=True)
        message: dict[str, Any] = {"role": "assistant", "content": None if calls and not content.strip() else content}
        if parse.reasoning is not None:
            message["reasoning_content"] = reasoning if parse.thinking else None
        if calls:
            message["tool_calls"] = [{"id": call_id(), "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return message, bool(calls)


class ChoiceParse:
    """One choice's parsers and checks: ``feed`` gives the (reasoning, content, calls) each new piece settles."""

    def __init__(self, shaper: ChatShaper) -> None:
        self.names = shaper.names
        self.reasoning: Any = None
        if shaper.reasoning_factory is not None:
            self.reasoning = _ContentAfterReasoning() if shaper.reasoning_done else _incremental(
                shaper.reasoning_factory())
        self.tools = _incremental(shaper.tool_factory()) if shaper.tool_factory else None

    @property
    def thinking(self) -> bool:
        return self.reasoning is not None and getattr(self.reasoning, "thinking", True) is not False

    def feed(self, text: str, final: bool) -> tuple[str, str, list[ToolCall]]:
        reasoning, content = self._split(text) if text else ("", "")
        if final and self.reasoning is not None:
            more = self._call(self.reasoning, "finish", None) or ("", "")
            reasoning, content = reasoning + more[0], content + more[1]
        pieces: list[Piece] = []
        if self.tools is None:
            pieces = [content]
        else:
            pieces = (self._call(self.tools, "feed", content) or []) if content else []
            if final:
                pieces += self._call(self.tools, "finish", None) or []
        out, calls = [], []
        for piece in pieces:
            if isinstance(piece, str):
                out.append(piece)
                continue
            checked = checked_calls(piece, self.names)
            out.append(piece.raw if checked is None else piece.kept)
            calls += checked or []
        return reasoning, "".join(out), calls

    def _split(self, text: str) -> tuple[str, str]:
        if self.reasoning is None:
            return "", text
        return self._call(self.reasoning, "feed", text) or ("", text)

    def _call(self, parser: Any, method: str, text: str | None) -> Any:
        """A parser's answer; if it raises, it is dropped and the rest of the answer is content."""
        try:
            return getattr(parser, method)() if text is None else getattr(parser, method)(text)
        except Exception as exc:  # noqa: BLE001 - a parser's bug must not end the request
            log.warning("%s parser failed: %s: %s; the rest of the answer is content", type(parser).__name__,
                        type(exc).__name__, exc)
            if parser is self.reasoning:
                self.reasoning = _ContentAfterReasoning()
                return ("", text or "")
            self.tools = _Content()
            return [text] if text else []


class _Content:
    """What replaces a tool parser that failed: everything is content."""

    def feed(self, text: str) -> list[Piece]:
        return [text]

    def finish(self) -> list[Piece]:
        return []


class _ContentAfterReasoning:
    """What replaces a reasoning parser that failed, or one whose prompt closed the reasoning: all is content."""

    thinking = False

    def feed(self, text: str) -> tuple[str, str]:
        return "", text

    def finish(self) -> tuple[str, str]:
        return "", ""


class ChatDeltas:
    """The streamed deltas of one choice, fed each step's new text; ``calls`` tells whether any call went out.
    Content that is only whitespace is held until more content comes (or the end), so an answer of calls
    separated by newlines streams no content, as its message has none."""

    def __init__(self, shaper: ChatShaper) -> None:
        self.parse = shaper.choice()
        self.sent_calls = 0
        self.sent_content = False
        self.blank: list[str] = []  # whitespace-only content held back (in pieces: linear however long)

    @property
    def calls(self) -> bool:
        return bool(self.sent_calls)

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The delta of the new ``text`` (what this step added to the answer)."""
        reasoning, content, calls = self.parse.feed(text, final)
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if not self.sent_content and not content.strip():  # nothing but whitespace so far: held
            self.blank.append(content)
            content = ""
            if final and not (self.sent_calls or calls):  # (an answer of calls and whitespace has no content)
                content = "".join(self.blank)
        elif self.blank:
            content, self.blank = "".join(self.blank) + content, []
        if content:
            delta["content"] = content
            self.sent_content = True
        if calls:
            delta["tool_calls"] = [{"index": self.sent_calls + i, "id": call_id(), "type": "function",
                                    "function": {"name": c.name, "arguments": c.arguments}}
                                   for i, c in enumerate(calls)]
            self.sent_calls += len(calls)
        return delta
