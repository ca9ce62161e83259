"""OpenAI request bodies (pydantic) and the error bodies the server answers with.

Every field is checked here, so a bad one answers 400 naming it before any work is
queued. Types are strict (``"5"``, ``true`` and ``5.0`` are not the integer 5; an integer
is a number), ``null`` means "not set", and an unknown field is refused by name: a
misspelt ``max_token`` must not silently run with the default length. Every field of vLLM's
own request models is declared here and either implemented with vLLM's meaning or refused by
name (``_REFUSED``), never silently ignored (see docs/vllm_compat.md). The structured-output and
tool fields are declared in ``structured_protocol``. The penalty, bias and logprob fields go through
``sampling_fields`` (shared with batch files).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator

from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.serve import request_rules as rules
from pagedkv.serve.sampling_fields import FieldError, sampling_extras
from pagedkv.serve.strict_body import StrictBody
from pagedkv.serve.structured_protocol import StructuredFields, ToolFields, ToolMessageFields


class StreamOptions(StrictBody):
    include_usage: bool = True  # vLLM's default when stream_options is given
    continuous_usage_stats: bool = False  # usage (so far) on every chunk, with include_usage


# --- vLLM's fields (issue 26): each implemented with vLLM's meaning, or refused by name -------------

# Declared (so they are never silently dropped) but not implemented: a request that sets one answers
# 400 naming it. Structured outputs (structured_outputs, guided_*) are in structured_protocol.
_REFUSED = {
    "structural_tag": "structural tags are not supported by pagedkv",
    "logits_processors": "per-request logits processors are not supported by pagedkv (write a plugin)",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported by pagedkv",
    "kv_transfer_params": "KV transfer (disaggregated serving) is not supported by pagedkv",
    "vllm_xargs": "vllm_xargs (custom extension parameters) is not supported by pagedkv",
    "repetition_detection": "repetition_detection is not supported by pagedkv",
    "mm_processor_kwargs": "pagedkv serves text-only models",
    "media_io_kwargs": "pagedkv serves text-only models",
    "prompt_embeds": "prompt embeddings are not supported by pagedkv; send text or token ids",
    "reasoning_effort": "reasoning_effort is not supported by pagedkv",
}


class _VllmFields(StrictBody):
    """vLLM's sampling and extra parameters shared by both endpoints (``extra_body`` in the OpenAI SDK)."""

    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    priority: int = 0
    cache_salt: str | None = None
    return_token_ids: bool | None = None
    request_id: str | None = None
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    structural_tag: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    repetition_detection: Any = None
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None

    def refuse_vllm_unsupported(self) -> None:
        for name, why in _REFUSED.items():
            if getattr(self, name, None) not in (None, False):
                raise InvalidField(name, why)
        if self.use_beam_search:
            raise InvalidField("use_beam_search", "beam search is not supported by pagedkv")
        if self.best_of is not None and self.best_of != getattr(self, "n", 1):
            raise InvalidField("best_of", "best_of is not supported by pagedkv (leave it unset or equal to n)")
        if self.length_penalty != 1.0:
            raise InvalidField("length_penalty", "length_penalty applies to beam search, which pagedkv does not do")
        if self.cache_salt is not None and not self.cache_salt:
            raise InvalidField("cache_salt", "cache_salt must be a non-empty string")
        if self.truncate_prompt_tokens == 0:
            raise InvalidField("truncate_prompt_tokens", "truncate_prompt_tokens must be >= 1 (or -1)")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise InvalidField("allowed_token_ids", "allowed_token_ids must not be empty")

    def vllm_sampling(self) -> dict[str, Any]:
        """The vLLM fields that are ``SamplingParams`` fields, as keyword arguments."""
        return {
            "stop_token_ids": list(self.stop_token_ids or []),
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "bad_words": list(self.bad_words or []),
            "allowed_token_ids": self.allowed_token_ids,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
        }

    def engine_options(self) -> dict[str, Any]:
        """What ``Engine.add_request`` takes besides the prompt and sampling parameters."""
        options: dict[str, Any] = {}
        if self.cache_salt is not None:
            options["cache_salt"] = self.cache_salt
        if self.priority:
            options["priority"] = self.priority
        return options


# Sampling defaults when a request leaves a field unset and the model's generation config
# (--generation-config) has no value for it: OpenAI's / vLLM's.
_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


class _Common(_VllmFields, StructuredFields):
    """Fields shared by /v1/completions and /v1/chat/completions (sampling, streaming, vLLM's extras).

    ``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` left unset take the
    model's generation config (``--generation-config auto``), else OpenAI's defaults, as vLLM.
    """

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=64)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int | None = Field(default=None, ge=-1)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    prompt_logprobs: int | None = None

    @field_validator("stop")
    @classmethod
    def _stops_are_bounded(cls, value: str | list[str] | None) -> list[str]:
        try:
            return rules.stop_strings(value)
        except FieldError as exc:
            raise ValueError(exc.message) from None

    @field_validator("logit_bias")
    @classmethod
    def _bias_is_bounded(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and len(value) > rules.MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(value)} entries; at most {rules.MAX_LOGIT_BIAS} are allowed")
        return value

    def refuse_unsupported(self) -> None:
        """Fields with an OpenAI meaning pagedkv does not implement: a 400 beats a silently different answer."""
        self.refuse_vllm_unsupported()
        if self.stream and self.prompt_logprobs is not None:
            raise InvalidField("prompt_logprobs", "prompt_logprobs is not supported with stream: true")
        if self.stream_options is not None and not self.stream:
            raise InvalidField("stream_options", "stream_options is only allowed when stream is true")

    def sampling_params(self, max_tokens: int, vocab_size: int | None = None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """``defaults``: the model's generation-config values for fields this request left unset."""
        if self.min_tokens > max_tokens:
            raise InvalidField("min_tokens", f"min_tokens ({self.min_tokens}) is above max_tokens ({max_tokens})")
        fields = self.model_dump(include=_EXTRA_FIELDS)
        chosen = {}
        for name, fallback in _SAMPLING_DEFAULTS.items():
            value = getattr(self, name)
            chosen[name] = value if value is not None else (defaults or {}).get(name, fallback)
        fields["min_p"], fields["repetition_penalty"] = chosen.pop("min_p"), chosen.pop("repetition_penalty")
        try:
            extras = sampling_extras(fields, isinstance(self, ChatCompletionRequest), vocab_size)
        except FieldError as exc:
            raise InvalidField(exc.param, exc.message) from None
        return SamplingParams(
            max_tokens=max_tokens, temperature=float(chosen["temperature"]), top_k=max(int(chosen["top_k"]), 0),
            top_p=float(chosen["top_p"]), seed=self.seed, n=self.n, stop=list(self.stop or []),
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, **extras, **self.vllm_sampling(),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``: usage on every chunk (with ``include_usage``)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


_EXTRA_FIELDS = {"presence_penalty", "frequency_penalty", "min_p", "repetition_penalty", "logit_bias", "logprobs",
                 "top_logprobs", "prompt_logprobs"}


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # null also means 16 (OpenAI's and vLLM's default)
    echo: bool = False  # the prompt's text before the completion
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # e.g. BOS before a text prompt (vLLM's default for completions)
    prompt_embeds: Any = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo and (self.logprobs is not None or self.prompt_logprobs is not None):
            raise InvalidField("echo", "echo together with logprobs is not supported by pagedkv")
        if self.suffix:
            raise InvalidField("suffix", "suffix is not supported by pagedkv")

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: text, or token ids; one engine request each."""
        prompt = self.prompt
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        else:
            prompts = list(prompt)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise InvalidField("prompt", "prompt must not be empty")
        if len(prompts) > rules.MAX_PROMPTS:
            raise InvalidField("prompt", f"prompt has {len(prompts)} prompts; at most {rules.MAX_PROMPTS} are allowed")
        return prompts


class ChatMessage(ToolMessageFields):
    role: Literal["system", "user", "assistant", "tool", "developer"]  # request_rules.CHAT_ROLES
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (vLLM's shape: tool-call arguments parsed from JSON)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [_parsed_call(call) for call in self.tool_calls]
        return message

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        try:
            rules.content_text(value)
        except FieldError as exc:
            raise ValueError(exc.message) from None
        return value

    def text(self) -> str:
        """The message's text: a string, or the text parts of a content list."""
        return rules.content_text(self.content)


class ChatCompletionRequest(_Common, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=rules.MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    reasoning_effort: Any = None
    include_reasoning: bool = True  # vLLM's meaning: with a reasoning parser, reasoning_content is returned
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is continued, not closed
    add_special_tokens: bool = False  # the chat template adds them (vLLM's default for chat)
    echo: bool = False  # the answer starts with the last message's text when it is the assistant's
    documents: list[dict[str, str]] | None = None  # for RAG templates
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.continue_final_message and self.add_generation_prompt and "add_generation_prompt" in \
                self.model_fields_set:
            raise InvalidField("continue_final_message", "continue_final_message and add_generation_prompt "
                               "cannot both be true")
        reserved = set(self.chat_template_kwargs or {}) & _TEMPLATE_ARGUMENTS
        if reserved:
            raise InvalidField("chat_template_kwargs", f"chat_template_kwargs may not set {sorted(reserved)}; "
                               "use the request fields of those names")

    def template_arguments(self) -> dict[str, Any]:
        """Keyword arguments for ``tokenizer.apply_chat_template`` (besides the conversation)."""
        kwargs: dict[str, Any] = dict(self.chat_template_kwargs or {})
        kwargs["add_generation_prompt"] = self.add_generation_prompt and not self.continue_final_message
        kwargs["continue_final_message"] = self.continue_final_message
        if self.documents is not None:
            kwargs["documents"] = self.documents
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        return kwargs

    def echo_text(self) -> str:
        """vLLM's chat ``echo``: the last message's text, when it is the assistant's (the answer's role)."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    def wanted_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]


_TEMPLATE_ARGUMENTS = {"conversation", "tokenize", "add_generation_prompt", "continue_final_message", "tools",
                       "documents", "chat_template", "return_dict", "return_tensors", "padding", "truncation"}


def _parsed_call(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call with its ``function.arguments`` JSON string parsed (templates index into it)."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        raise InvalidField("messages", "a tool call's function.arguments must be a JSON string") from None
    return {**call, "function": {**function, "arguments": arguments}}


class InvalidField(Exception):
    """A request field the server refuses: answered 400 with the field as ``param``."""

    def __init__(self, param: str | None, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.message, self.status, self.kind = param, message, status, kind


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: int | str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def validation_error_body(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """A pydantic/FastAPI validation failure as one OpenAI error naming the first bad field."""
    first = errors[0] if errors else {}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # a union type adds its member type names to the location: keep the field path only
    param = ".".join(p for p in loc if not _is_type_name(p)) or None
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        message = "unknown field: pagedkv does not know it (check its spelling)"
    if param:
        message = f"{param}: {message}"
    return error_body(message, param=param, code=400)


def _is_type_name(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "list[int]", "list[str]", "list[list[int]]"} or (
        "[" in part or part.startswith("function-")
    )
