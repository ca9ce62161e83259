"""A streamed chat completion, re-spelt as the Responses API's server-sent events.

The chat stream's deltas (reasoning, content, tool calls) open and close output items in order:
``response.created`` and ``response.in_progress`` first; per item ``response.output_item.added``, its
content part (``response.content_part.added``), its deltas (``response.output_text.delta``,
``response.reasoning_text.delta``, ``response.function_call_arguments.delta``), their ``.done``
events and ``response.output_item.done``; last ``response.completed`` (or ``response.incomplete`` /
``response.failed``) carrying the whole response and its usage. Every event has a ``sequence_number``
and goes out as ``event: TYPE`` + ``data: JSON`` (the SDK reads both).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pagedkv.serve.responses_output import (
    ResponseHead,
    call_item,
    item_id,
    message_item,
    reasoning_item,
    status_of,
    text_part,
    usage_of,
)


class _Item:
    """One open output item: its kind, id, place, and the text (or arguments) sent so far."""

    def __init__(self, kind: str, index: int, call: dict[str, Any] | None = None) -> None:
        self.kind, self.index, self.text = kind, index, ""
        self.id = item_id({"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind])
        self.call_id, self.name = (call or {}).get("id", ""), ((call or {}).get("function") or {}).get("name", "")

    def shape(self, status: str) -> dict[str, Any]:
        done = status != "in_progress"
        if self.kind == "reasoning":
            return reasoning_item(self.text if done else "", status, self.id)
        if self.kind == "message":
            return message_item(self.text if done else None, status, self.id)
        return call_item(self.call_id, self.name, self.text if done else "", status, self.id)


class ResponseEvents:
    """The Responses events of one streamed answer, built from its chat chunks."""

    def __init__(self, head: ResponseHead) -> None:
        self.head, self.sequence = head, 0
        self.items: list[_Item] = []
        self.open: _Item | None = None
        self.calls: dict[int, _Item] = {}  # chat tool-call index -> its item
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        response = self.head.response("in_progress", [])
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def _where(self, item: _Item) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": item.index}

    def _open(self, kind: str, call: dict[str, Any] | None = None) -> list[str]:
        events = self._close()
        item = _Item(kind, len(self.items), call)
        self.items.append(item)
        self.open = item
        events.append(self.event("response.output_item.added", output_index=item.index,
                                 item=item.shape("in_progress")))
        if kind != "function_call":
            part = text_part("") if kind == "message" else {"type": "reasoning_text", "text": ""}
            events.append(self.event("response.content_part.added", **self._where(item), content_index=0, part=part))
        return events

    def _close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = self._where(item)
        if item.kind == "function_call":
            events = [self.event("response.function_call_arguments.done", **where, arguments=item.text)]
        else:
            part = text_part(item.text) if item.kind == "message" else {"type": "reasoning_text", "text": item.text}
            done = "response.output_text.done" if item.kind == "message" else "response.reasoning_text.done"
            extra = {"logprobs": []} if item.kind == "message" else {}
            events = [self.event(done, **where, content_index=0, text=item.text, **extra),
                      self.event("response.content_part.done", **where, content_index=0, part=part)]
        events.append(self.event("response.output_item.done", output_index=item.index,
                                 item=item.shape(self._item_status(item))))
        return events

    def _item_status(self, item: _Item) -> str:
        return "completed" if item.kind != "message" or status_of(self.finish) == "completed" else "incomplete"

    def _text(self, kind: str, text: str) -> list[str]:
        events = [] if self.open is not None and self.open.kind == kind else self._open(kind)
        item = self.open
        assert item is not None
        item.text += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        return [*events, self.event(name, **self._where(item), content_index=0, delta=text, **extra)]

    def chunk(self, chunk: dict[str, Any]) -> list[str]:
        """The events for one chat chunk (its usage and finish reason are kept for the end)."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events: list[str] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
            self.finish = choice.get("finish_reason") or self.finish
        return events

    def _call(self, call: dict[str, Any]) -> list[str]:
        events = []
        if call.get("id"):  # a new call: it opens its own item
            events = self._open("function_call", call)
            assert self.open is not None
            self.calls[call["index"]] = self.open
        item = self.calls.get(call.get("index", -1))
        arguments = (call.get("function") or {}).get("arguments")
        if item is not None and arguments:
            item.text += arguments
            events.append(self.event("response.function_call_arguments.delta", **self._where(item), delta=arguments))
        return events

    def end(self) -> list[str]:
        """Close what is open and send the final response (an answer with no item gets an empty message)."""
        events = [] if self.items else self._open("message")
        events += self._close()
        status = status_of(self.finish)
        output = [item.shape(self._item_status(item)) for item in self.items]
        response = self.head.response(status, output, usage_of(self.usage), self.finish)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
        if status == "cancelled":
            response["error"] = {"code": "server_error", "message": "the server stopped this response"}
        return [*events, self.event(kind, response=response)]

    def failed(self, error: dict[str, Any]) -> list[str]:
        message = str(error.get("message", "the request failed"))
        response = self.head.response("failed", [item.shape("incomplete") for item in self.items],
                                      usage_of(self.usage), error={"code": "server_error", "message": message})
        return [self.event("error", code="server_error", message=message, param=None),
                self.event("response.failed", response=response)]


async def response_events(head: ResponseHead, chat_sse: AsyncIterator[Any]) -> AsyncIterator[str]:
    """The Responses events of a chat stream; leaving early closes the chat stream (its requests abort)."""
    events = ResponseEvents(head)
    try:
        for event in events.start():
            yield event
        async for raw in chat_sse:
            text = raw.decode() if isinstance(raw, bytes) else raw
            for line in text.splitlines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    for event in events.failed(chunk["error"]):
                        yield event
                    return
                for event in events.chunk(chunk):
                    yield event
        for event in events.end():
            yield event
    finally:
        closing = getattr(chat_sse, "aclose", None)
        if closing is not None:
            await closing()
