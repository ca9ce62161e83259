"""The Responses API's ``response`` object, built from a chat completion's answer.

One chat choice becomes the ``output`` list: a ``reasoning`` item (with a reasoning parser), a ``message``
item with one ``output_text`` part, and a ``function_call`` item per tool call, in that order; an answer
with nothing at all is an empty message, so ``output_text`` is always there to read. Finish reasons map to
the status: ``length`` -> ``incomplete`` (``max_output_tokens``), ``abort`` -> ``cancelled``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedkv.serve.api.responses_request import ResponsesRequest


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponseHead:
    """What every ``response`` object of one request repeats: its id, the request's settings, the time."""

    request: ResponsesRequest
    model: str
    id: str = field(default_factory=lambda: item_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 finish_reason: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.request
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": output, "usage": usage, "error": error,
            "incomplete_details": incomplete, "instructions": req.instructions, "metadata": req.metadata or {},
            "tools": [_echoed_tool(tool) for tool in req.tools or ()],
            "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
            "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": req.temperature,
            "top_p": req.top_p, "max_output_tokens": req.max_output_tokens, "previous_response_id": None,
            "reasoning": None, "store": False, "background": False, "truncation": "disabled",
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}}, "user": req.user,
        }


def _echoed_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A request's function tool as the response object lists it (every field present)."""
    return {"type": "function", "name": tool["name"], "description": tool.get("description"),
            "parameters": tool.get("parameters"), "strict": tool.get("strict")}


def status_of(finish_reason: str | None) -> str:
    return {"length": "incomplete", "abort": "cancelled"}.get(finish_reason or "stop", "completed")


def usage_of(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat's usage in the Responses spelling."""
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def reasoning_item(text: str, status: str = "completed", id_: str | None = None) -> dict[str, Any]:
    return {"id": id_ or item_id("rs"), "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text or status == "completed" else []}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str | None, status: str = "completed", id_: str | None = None) -> dict[str, Any]:
    return {"id": id_ or item_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [text_part(text)]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed",
              id_: str | None = None) -> dict[str, Any]:
    return {"id": id_ or item_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(message: dict[str, Any], status: str) -> list[dict[str, Any]]:
    """A chat choice's assistant message as output items."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not (calls or items):
        items.append(message_item(message.get("content") or "", status))
    for call in calls:
        items.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return items


def response_from_chat(head: ResponseHead, completion: dict[str, Any]) -> dict[str, Any]:
    """The whole ``response`` object for a non-streamed chat completion body."""
    choice = completion["choices"][0]
    finish = choice.get("finish_reason")
    status = status_of(finish)
    return head.response(status, output_items(choice["message"], "incomplete" if status != "completed"
                                              else "completed"), usage_of(completion.get("usage")), finish)
