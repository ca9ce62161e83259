"""The body fields a batch line takes: exactly those of ``engine serve``'s request models, with their types.

``engine serve`` declares its fields with pydantic (``serve/protocol.py``); the batch reader
must run without the server's stack, so the same fields and JSON types are listed here, and
the rules between fields come from the modules both share (``serve/vllm_fields.py``,
``serve/chat_fields.py``, ``serve/sampling_fields.py``, ``serve/request_rules.py``).
``tests/test_one_validator.py`` checks that these tables name every field of the server's
models and sends the same bodies to both front ends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedkv.serve import chat_fields, vllm_fields
from pagedkv.serve.api.errors import InvalidField
from pagedkv.serve.structured_fields import FIELDS as STRUCTURED_FIELDS

# field -> JSON kind (checked here: int, number, bool, str, object, documents, int_list, str_list; any:
# checked where the field is read)
_COMMON: dict[str, str] = {
    "model": "str", "user": "str", "stream": "bool", "stream_options": "stream_options", "max_tokens": "int",
    "temperature": "number", "top_p": "number", "n": "int", "stop": "any", "seed": "int", "top_k": "int",
    "min_tokens": "int", "ignore_eos": "bool", "frequency_penalty": "any", "presence_penalty": "any",
    "logit_bias": "any", "min_p": "any", "repetition_penalty": "any", "prompt_logprobs": "any",
    **{name: kind for name, (kind, _) in vllm_fields.KINDS.items()}, **dict.fromkeys(STRUCTURED_FIELDS, "any"),
}
COMPLETION_FIELDS = {**_COMMON, "prompt": "any", "echo": "bool", "logprobs": "any", "suffix": "str",
                     "add_special_tokens": "bool", "prompt_embeds": "any"}
CHAT_FIELDS = {**_COMMON, "messages": "any", "max_completion_tokens": "int", "logprobs": "any",
               "top_logprobs": "any", "reasoning_effort": "any", "include_reasoning": "bool",
               "add_generation_prompt": "bool", "continue_final_message": "bool", "add_special_tokens": "bool",
               "echo": "bool", "documents": "documents", "chat_template": "str", "chat_template_kwargs": "object",
               "tools": "any", "tool_choice": "any", "parallel_tool_calls": "bool"}
MESSAGE_FIELDS = {"role": "any", "content": "any", "name": "str", "tool_calls": "object_list",
                  "tool_call_id": "str", "reasoning_content": "str"}
_DEFAULTS = {"stream": False, "echo": False, "include_reasoning": True, "add_generation_prompt": True,
             "continue_final_message": False, "min_tokens": 0, "n": 1, "ignore_eos": False}
_STREAM_OPTIONS = {"include_usage", "continuous_usage_stats"}

_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (lambda v: type(v) is int, "an integer"),
    "number": (lambda v: type(v) in (int, float), "a number"),
    "bool": (lambda v: type(v) is bool, "true or false"),
    "str": (lambda v: type(v) is str, "a string"),
    "object": (lambda v: type(v) is dict, "an object"),
    "int_list": (lambda v: type(v) is list and all(type(x) is int for x in v), "a list of integers"),
    "str_list": (lambda v: type(v) is list and all(type(x) is str for x in v), "a list of strings"),
    "object_list": (lambda v: type(v) is list and all(type(x) is dict for x in v), "a list of objects"),
    "documents": (lambda v: type(v) is list and all(type(d) is dict and all(type(x) is str for x in d.values())
                                                    for d in v), "a list of objects of strings"),
    "stream_options": (lambda v: type(v) is dict and set(v) <= _STREAM_OPTIONS
                       and all(type(x) is bool for x in v.values()), "{include_usage, continuous_usage_stats}"),
}


def check_types(fields: dict[str, str], body: dict[str, Any], where: str = "") -> None:
    """Unknown fields and wrong JSON types as ``InvalidField`` (``null`` is "not set", as the server reads it)."""
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise InvalidField(where + unknown[0], f"unknown field(s) {', '.join(where + u for u in unknown)}: pagedkv "
                         "does not know them (check the spelling)")
    for name, value in body.items():
        check = _CHECKS.get(fields[name])
        if value is not None and check is not None and not check[0](value):
            raise InvalidField(where + name, f"{where}{name} must be {check[1]}, got {value!r:.80}")


def check_body(chat: bool, body: dict[str, Any]) -> Callable[[str], Any]:
    """Check a line's body as the server checks a request; ``value(name)``: the field or its default."""
    check_types(CHAT_FIELDS if chat else COMPLETION_FIELDS, body)
    defaults = {**_DEFAULTS, "add_special_tokens": not chat}

    def value(name: str) -> Any:
        found = body.get(name)
        if found is not None:
            return found
        return defaults[name] if name in defaults else vllm_fields.KINDS.get(name, ("any", None))[1]

    vllm_fields.check(value, value("n"))
    if value("stream") and value("prompt_logprobs") is not None:
        raise InvalidField("prompt_logprobs", "prompt_logprobs is not supported with stream: true")
    if value("stream_options") is not None and not value("stream"):
        raise InvalidField("stream_options", "stream_options is only allowed when stream is true")
    if chat:
        chat_fields.check(value, body.get("add_generation_prompt") is not None)
    else:
        if value("echo") and (value("logprobs") is not None or value("prompt_logprobs") is not None):
            raise InvalidField("echo", "echo together with logprobs is not supported by pagedkv")
        if value("suffix"):
            raise InvalidField("suffix", "suffix is not supported by pagedkv")
    return value
