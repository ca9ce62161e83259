"""The Responses API's ``input`` items, ``tools`` and ``tool_choice`` -> the chat completion spellings.

Items become chat messages: a ``message`` item (``input_text`` / ``output_text`` parts, or a string) is a
message of its role; ``function_call`` items become an assistant message's ``tool_calls`` (consecutive
calls, and calls right after an assistant message, share one message, as a chat client sends parallel
calls); a ``function_call_output`` is a ``tool`` message; a ``reasoning`` item's text goes to the next
assistant message's ``reasoning_content``. Anything else is refused naming its place in ``input``.
"""

from __future__ import annotations

from typing import Any

from pagedkv.serve.api.errors import InvalidField

ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = {"user": "input_text", "system": "input_text", "developer": "input_text", "assistant": "output_text"}
# keys that identify an item (echoed back by clients from an earlier response) but mean nothing to the prompt
_ITEM_BOOKKEEPING = {"id", "status", "type"}
_ITEM_KEYS = {
    "message": {"role", "content", "phase"},
    "function_call": {"call_id", "name", "arguments"},
    "function_call_output": {"call_id", "output"},
    "reasoning": {"summary", "content"},
}
_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}


def _text_of(where: str, content: Any, role: str) -> str:
    """A message item's text: a string, or its text parts (``input_text``; ``output_text`` for the assistant)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidField(where, f"{where} must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        spot = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            wanted = _TEXT_PARTS[role]
            raise InvalidField(f"{spot}.type", f"{spot}: only text parts ({{'type': '{wanted}', 'text': ...}}) are "
                               f"supported by pagedkv, got {kind!r}")
        extra = sorted(set(part) - {"type", "text", "annotations", "logprobs"})
        if extra:
            raise InvalidField(f"{spot}.{extra[0]}", f"{spot}.{extra[0]} is not supported by pagedkv")
        texts.append(part["text"])
    return "".join(texts)


def _checked_item(i: int, item: Any) -> tuple[str, dict[str, Any]]:
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise InvalidField(where, f"{where} must be an object (a message, function_call or function_call_output)")
    item = {key: value for key, value in item.items() if value is not None}  # null is unset, as in a body
    kind = item.get("type", "message")
    if kind not in _ITEM_KEYS:
        raise InvalidField(f"{where}.type", f"{where}.type {kind!r} is not supported by pagedkv (supported: "
                           f"{', '.join(_ITEM_KEYS)}); this server is stateless and runs no hosted tools")
    extra = sorted(set(item) - _ITEM_KEYS[kind] - _ITEM_BOOKKEEPING)
    if extra:
        raise InvalidField(f"{where}.{extra[0]}", f"{where}.{extra[0]} is not supported by pagedkv")
    for key in sorted(_ITEM_KEYS[kind] - {"phase", "summary", "content", "output"}):
        if not isinstance(item.get(key), str):
            raise InvalidField(f"{where}.{key}", f"{where}.{key} must be a string")
    return kind, item


def _reasoning_text(where: str, item: dict[str, Any]) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise InvalidField(f"{where}.content", f"{where}.content must be a list of reasoning_text parts")
    return "".join(p["text"] for p in parts)


def input_messages(value: str | list[Any], instructions: str | None) -> list[dict[str, Any]]:
    """The chat messages of ``instructions`` (a leading system message) and ``input``."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(value, str):
        return [*messages, {"role": "user", "content": value}]
    reasoning: str | None = None
    for i, raw in enumerate(value):
        kind, item = _checked_item(i, raw)
        where = f"input[{i}]"
        last = messages[-1] if messages else None
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise InvalidField(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}")
            message: dict[str, Any] = {"role": role, "content": _text_of(f"{where}.content", item.get("content"),
                                                                         role)}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning is not None:
                    message["reasoning_content"], reasoning = reasoning, None
                messages.append(message)
        elif kind == "function_call_output":
            output = _text_of(f"{where}.output", item.get("output"), "user")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        else:
            reasoning = (reasoning or "") + _reasoning_text(where, item)
    if reasoning is not None:  # reasoning that no answer followed still belongs to the history
        messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
    if not messages:
        raise InvalidField("input", "input has no items: give a string or at least one message")
    return messages


def chat_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """The Responses API's flat function tools as chat tools (``{"type": "function", "function": {...}}``)."""
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise InvalidField(f"{where}.type", f"{where}: only function tools are supported by pagedkv, got "
                               f"{kind!r} (this server runs no hosted tools)")
        tool = {key: value for key, value in tool.items() if value is not None}
        extra = sorted(set(tool) - _TOOL_KEYS)
        if extra:
            raise InvalidField(f"{where}.{extra[0]}", f"{where}.{extra[0]} is not supported by pagedkv")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """``none`` / ``auto`` / ``required``, or ``{"type": "function", "name": ...}`` in the chat spelling."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str) \
            and set(choice) <= {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidField("tool_choice", "tool_choice must be none, auto, required or {'type': 'function', 'name': ...} "
                       "(pagedkv has no hosted tools or allowed_tools)")
