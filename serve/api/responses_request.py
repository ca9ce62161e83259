"""``/v1/responses``: the request model, stateless, and the equivalent chat completion request it becomes.

The server keeps nothing between requests, so ``store: true``, ``previous_response_id`` and
``conversation`` are refused by name, as is every field with a meaning pagedkv does not implement
(``background``, ``include``, hosted tools, ``reasoning`` settings...): an unknown field answers 400
naming it, never a silently different answer. What is accepted maps one to one onto chat fields, so
the answer comes from the chat path (template, tool calls, grammars, sampling) unchanged. vLLM's
sampling extras on this endpoint (``seed``, ``stop``, ``top_k``, ...) are accepted as on chat.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, ValidationError

from pagedkv.serve.api.chat import ChatCompletionRequest
from pagedkv.serve.api.errors import InvalidField, validation_error_body
from pagedkv.serve.api.responses_input import chat_tool_choice, chat_tools, input_messages
from pagedkv.serve.api.strict_body import StrictBody
from pagedkv.serve.api.vllm import PRIORITY_MAX, PRIORITY_MIN

# fields refused by name, with why: the Responses API's stateful or hosted features
REFUSED = {
    "previous_response_id": "previous_response_id needs stored responses; this server is stateless: send the whole "
                            "conversation as input items",
    "conversation": "conversations need server-side state; this server is stateless: send the whole conversation "
                    "as input items",
    "background": "background responses need stored responses; this server is stateless",
    "prompt": "stored prompt templates are not supported by pagedkv",
    "reasoning": "reasoning settings are not supported by pagedkv (the server's --reasoning-parser returns the "
                 "model's reasoning as reasoning items)",
    "max_tool_calls": "max_tool_calls limits hosted tool calls, which pagedkv does not run",
    "top_logprobs": "logprobs are not supported on /v1/responses by pagedkv (use /v1/chat/completions)",
}
# sampling fields vLLM's Responses endpoint takes beyond OpenAI's, passed to the chat request as they are
VLLM_EXTRAS = ("seed", "stop", "top_k", "repetition_penalty", "ignore_eos", "priority", "cache_salt",
               "structured_outputs")
# chat request fields -> the Responses field a client sent (for naming a refused field in an error)
CHAT_NAMES = (("messages", "input"), ("max_tokens", "max_output_tokens"),
              ("response_format.json_schema.schema", "text.format.schema"), ("response_format", "text.format"))


class ResponsesRequest(StrictBody):
    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    truncation: str | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    stream_options: Any = None
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    prompt: Any = None
    reasoning: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None
    seed: int | None = None
    stop: str | list[str] | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    priority: int | None = Field(default=None, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    cache_salt: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def check_refused(self) -> None:
        """Stateful and unimplemented fields, refused by name when set (``false`` / empty is allowed)."""
        if self.store:
            raise InvalidField("store", "store: true needs stored responses; this server is stateless (send "
                               "store: false, or leave it out)")
        for name, why in REFUSED.items():
            value = getattr(self, name)
            if value not in (None, False) and not (name == "reasoning" and value == {}):
                raise InvalidField(name, why)
        if self.truncation not in (None, "disabled"):
            raise InvalidField("truncation", "only truncation 'disabled' is supported: a prompt over the context "
                               "is refused, never cut")
        if self.include:
            raise InvalidField("include", f"include {self.include[0]!r} is not supported by pagedkv")
        if self.service_tier not in (None, "auto", "default"):
            raise InvalidField("service_tier", "pagedkv has one service tier (auto)")
        if self.stream_options is not None and not self.stream:
            raise InvalidField("stream_options", "stream_options is only allowed when stream is true")
        if self.stream_options not in (None, {}, {"include_obfuscation": False}):
            raise InvalidField("stream_options", "stream_options are not supported by pagedkv (no obfuscation)")

    def text_format(self) -> dict[str, Any] | None:
        """``text.format`` as chat's ``response_format`` (None: plain text)."""
        text = dict(self.text or {})
        fmt = text.pop("format", None)
        if text.get("verbosity") is not None:
            raise InvalidField("text.verbosity", "text.verbosity is not supported by pagedkv")
        if sorted(set(text) - {"verbosity"}):
            name = sorted(set(text) - {"verbosity"})[0]
            raise InvalidField(f"text.{name}", f"text.{name} is not supported by pagedkv")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise InvalidField("text.format.type", "text.format.type must be text, json_object or json_schema")
        if fmt["type"] != "json_schema":
            return {"type": fmt["type"]}
        extra = sorted(set(fmt) - {"type", "name", "schema", "strict", "description"})
        if extra:
            raise InvalidField(f"text.format.{extra[0]}", f"text.format.{extra[0]} is not supported by pagedkv")
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidField("text.format.schema", "text.format of type json_schema needs a schema object")
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}

    def chat_body(self) -> dict[str, Any]:
        """The equivalent chat completion body (raises ``InvalidField`` naming this request's field)."""
        self.check_refused()
        body: dict[str, Any] = {
            "model": self.model, "messages": input_messages(self.input, self.instructions),
            "max_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "stream": self.stream, "tool_choice": chat_tool_choice(self.tool_choice),
            "parallel_tool_calls": self.parallel_tool_calls, "response_format": self.text_format(),
            "user": self.user, **{name: getattr(self, name) for name in VLLM_EXTRAS},
        }
        if self.tools is not None:
            body["tools"] = chat_tools(self.tools)
        if self.stream:  # the final response.completed event carries the usage
            body["stream_options"] = {"include_usage": True}
        return {key: value for key, value in body.items() if value is not None}

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request this one runs as; a chat-side refusal names this request's field."""
        try:
            return ChatCompletionRequest.model_validate(self.chat_body())
        except InvalidField as exc:
            raise responses_error(exc) from None
        except ValidationError as exc:  # a type error in a converted value (a message's content...)
            error = validation_error_body(list(exc.errors(include_url=False)))["error"]
            raise responses_error(InvalidField(error["param"], error["message"])) from None


def responses_name(param: str | None) -> str | None:
    """A chat field's name as the Responses request spells it (``messages[2]`` -> ``input``)."""
    if param is None:
        return None
    for chat, ours in CHAT_NAMES:
        if param == chat or param.startswith((chat + ".", chat + "[")):
            return ours
    if param.startswith("tools[") and ".function." in param:
        return param.replace(".function.", ".", 1)
    return param


def responses_error(exc: InvalidField) -> InvalidField:
    """The same refusal, naming the Responses field the client sent rather than its chat equivalent."""
    param, message = responses_name(exc.param), exc.message
    if exc.param and exc.param.startswith("response_format"):  # the grammar compiler names its own field
        message = message.replace("structured_outputs", "text.format")
    for chat, ours in CHAT_NAMES[1:]:
        message = message.replace(chat, ours)
    message = re.sub(r"(tools\[\d+\])\.function", r"\1", message)
    return InvalidField(param, message, exc.status, exc.kind)
