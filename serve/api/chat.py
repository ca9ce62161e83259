"""``/v1/chat/completions``: the request model, its messages, and its chat-template fields.

``add_generation_prompt``, ``continue_final_message``, ``documents``, ``chat_template`` and
``chat_template_kwargs`` become the keyword arguments of ``apply_chat_template``; a message becomes
what templates read (tool-call arguments parsed from their JSON string, as vLLM). Only text content
is taken: a content list may hold ``{"type": "text"}`` parts and nothing else.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from pagedkv.serve.api.errors import InvalidField
from pagedkv.serve.api.generation import GenerationRequest
from pagedkv.serve.api.strict_body import StrictBody
from pagedkv.serve.api.tools import ToolFields, ToolMessageFields

MAX_MESSAGES = 1024  # chat messages in one request
# keyword arguments of apply_chat_template that chat_template_kwargs may not set (they have fields of their own)
TEMPLATE_ARGUMENTS = {"conversation", "tokenize", "add_generation_prompt", "continue_final_message", "tools",
                      "documents", "chat_template", "return_dict", "return_tensors", "padding", "truncation"}


class ChatMessage(ToolMessageFields):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        content_text(value)
        return value

    def text(self) -> str:
        """The message's text: a string, or the text parts of a content list."""
        return content_text(self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (vLLM's shape: tool-call arguments parsed from JSON)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [parsed_call(call) for call in self.tool_calls]
        return message


class ChatTemplateFields(StrictBody):
    """The fields that pick and drive the chat template (on chat, and on ``/tokenize`` with messages)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is continued, not closed
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check_generation_prompt(self) -> None:
        if self.continue_final_message and self.add_generation_prompt and \
                "add_generation_prompt" in self.model_fields_set:
            raise InvalidField("continue_final_message", "continue_final_message and add_generation_prompt "
                               "cannot both be true")

    def template_arguments(self) -> dict[str, Any]:
        """Keyword arguments for ``tokenizer.apply_chat_template`` (besides the conversation and the tools)."""
        kwargs: dict[str, Any] = dict(self.chat_template_kwargs or {})
        kwargs["add_generation_prompt"] = self.add_generation_prompt and not self.continue_final_message
        kwargs["continue_final_message"] = self.continue_final_message
        if getattr(self, "documents", None) is not None:
            kwargs["documents"] = self.documents
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        return kwargs


class ChatCompletionRequest(GenerationRequest, ChatTemplateFields, ToolFields):
    chat: ClassVar[bool] = True

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    reasoning_effort: Any = None
    include_reasoning: bool = True  # vLLM's meaning: with a reasoning parser, reasoning_content is returned
    add_special_tokens: bool = False  # the chat template adds them (vLLM's default for chat)
    echo: bool = False  # the answer starts with the last message's text when it is the assistant's
    documents: list[dict[str, str]] | None = None  # for RAG templates

    def check_rules(self) -> None:
        super().check_rules()
        self.check_generation_prompt()
        reserved = set(self.chat_template_kwargs or {}) & TEMPLATE_ARGUMENTS
        if reserved:
            raise InvalidField("chat_template_kwargs", f"chat_template_kwargs may not set {sorted(reserved)}; "
                               "use the request fields of those names")

    def conversation(self) -> list[dict[str, Any]]:
        """The prompt: the messages as the chat template reads them."""
        return [m.for_template() for m in self.messages]

    def echo_text(self) -> str:
        """vLLM's chat ``echo``: the last message's text, when it is the assistant's (the answer's role)."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    def wanted_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"


def content_text(content: Any) -> str:
    """A message's text: a string, null, or a list of ``{"type": "text", "text": ...}`` parts (nothing else).

    Raises ``ValueError``: it runs as a field validator, and pydantic names the message's field.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("content must be a string or a list of text parts")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
        if extra := sorted(set(part) - {"type", "text"}):
            raise ValueError(f"unknown field(s) in a text part: {', '.join(extra)}")
        parts.append(part["text"])
    return "".join(parts)


def parsed_call(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call with its ``function.arguments`` JSON string parsed (templates index into it)."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except RecursionError:  # not a ValueError: it used to escape as a 500
        raise InvalidField("messages", "a tool call's function.arguments is nested too deeply") from None
    except ValueError as exc:  # the string is there; its text is not JSON (say where, not "must be a string")
        where = f"{exc.msg} at character {exc.pos}" if isinstance(exc, json.JSONDecodeError) else str(exc)[:80]
        raise InvalidField("messages", f"a tool call's function.arguments is not valid JSON ({where})") from None
    return {**call, "function": {**function, "arguments": arguments}}


def render_chat(tokenizer: Any, model_name: str, conversation: list[dict[str, Any]],
                template_arguments: dict[str, Any]) -> str:
    """The conversation through the chat template (the request's, else the model's), as text."""
    if tokenizer is None or not (getattr(tokenizer, "chat_template", None) or template_arguments.get("chat_template")):
        raise InvalidField("messages", f"model {model_name!r} has no chat template, so it cannot answer "
                           "chat requests; use /v1/completions with a plain prompt")
    try:
        return tokenizer.apply_chat_template(conversation, tokenize=False, **template_arguments)
    except Exception as exc:  # noqa: BLE001 - a template error is the request's (continue_final_message on a user turn)
        raise InvalidField("messages", f"the chat template refused these messages: {type(exc).__name__}: "
                           f"{str(exc)[:200]}") from None
