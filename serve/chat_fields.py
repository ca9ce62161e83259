"""The chat-template fields of a chat request, one definition for ``engine serve`` and batch files.

``add_generation_prompt``, ``continue_final_message``, ``documents``, ``chat_template`` and
``chat_template_kwargs`` become the keyword arguments of ``apply_chat_template``; a message
becomes what templates read (tool-call arguments parsed from their JSON string, as vLLM).
No pydantic here: the batch reader must not need the server's stack.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pagedkv.serve.api.errors import InvalidField

# keyword arguments of apply_chat_template that chat_template_kwargs may not set (they have fields of their own)
TEMPLATE_ARGUMENTS = {"conversation", "tokenize", "add_generation_prompt", "continue_final_message", "tools",
                      "documents", "chat_template", "return_dict", "return_tensors", "padding", "truncation"}


def check(value: Callable[[str], Any], generation_prompt_given: bool) -> None:
    """The rules between the template fields; ``value(name)`` is the field's value or its default."""
    if value("continue_final_message") and value("add_generation_prompt") and generation_prompt_given:
        raise InvalidField("continue_final_message", "continue_final_message and add_generation_prompt "
                         "cannot both be true")
    reserved = set(value("chat_template_kwargs") or {}) & TEMPLATE_ARGUMENTS
    if reserved:
        raise InvalidField("chat_template_kwargs", f"chat_template_kwargs may not set {sorted(reserved)}; "
                         "use the request fields of those names")


def template_arguments(value: Callable[[str], Any]) -> dict[str, Any]:
    """Keyword arguments for ``tokenizer.apply_chat_template`` (besides the conversation and the tools)."""
    kwargs: dict[str, Any] = dict(value("chat_template_kwargs") or {})
    kwargs["add_generation_prompt"] = value("add_generation_prompt") and not value("continue_final_message")
    kwargs["continue_final_message"] = bool(value("continue_final_message"))
    if value("documents") is not None:
        kwargs["documents"] = value("documents")
    if value("chat_template") is not None:
        kwargs["chat_template"] = value("chat_template")
    return kwargs


def for_template(role: str, text: str, name: str | None, tool_call_id: str | None,
                 tool_calls: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A message as chat templates read it (vLLM's shape: tool-call arguments parsed from JSON)."""
    message: dict[str, Any] = {"role": role, "content": text}
    if name is not None:
        message["name"] = name
    if tool_call_id is not None:
        message["tool_call_id"] = tool_call_id
    if tool_calls:
        message["tool_calls"] = [parsed_call(call) for call in tool_calls]
    return message


def parsed_call(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call with its ``function.arguments`` JSON string parsed (templates index into it)."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        raise InvalidField("messages", "a tool call's function.arguments must be a JSON string") from None
    return {**call, "function": {**function, "arguments": arguments}}
