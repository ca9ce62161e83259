"""OpenAI request bodies (pydantic) and the error bodies the server answers with.

Every field is checked here, so a bad one answers 400 naming it before any work is
queued. Unknown fields are ignored (as vLLM does); fields OpenAI defines that pagedkv
cannot honour (echo, suffix, ...) are refused by name rather than ignored. The structured-output
and tool fields are declared in ``structured_protocol``. The
penalty, bias and logprob fields go through ``sampling_fields`` (shared with batch files).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.serve.sampling_fields import FieldError, sampling_extras
from pagedkv.serve.structured_protocol import StructuredFields, ToolFields, ToolMessageFields


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(StructuredFields):
    """Fields shared by /v1/completions and /v1/chat/completions (sampling, streaming, vLLM's extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=64)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int = Field(default=0, ge=-1)
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
    def _stops_are_non_empty(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    def refuse_unsupported(self) -> None:
        """Fields with an OpenAI meaning pagedkv does not implement: a 400 beats a silently different answer."""
        if self.stream and self.prompt_logprobs is not None:
            raise InvalidField("prompt_logprobs", "prompt_logprobs is not supported with stream: true")
        if self.stream_options is not None and not self.stream:
            raise InvalidField("stream_options", "stream_options is only allowed when stream is true")

    def sampling_params(self, max_tokens: int, vocab_size: int | None = None) -> SamplingParams:
        if self.min_tokens > max_tokens:
            raise InvalidField("min_tokens", f"min_tokens ({self.min_tokens}) is above max_tokens ({max_tokens})")
        try:
            extras = sampling_extras(self.model_dump(include=_EXTRA_FIELDS), isinstance(self, ChatCompletionRequest),
                                     vocab_size)
        except FieldError as exc:
            raise InvalidField(exc.param, exc.message) from None
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_k=max(self.top_k, 0), top_p=self.top_p,
            seed=self.seed, n=self.n, stop=list(self.stop or []), ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, **extras,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


_EXTRA_FIELDS = {"presence_penalty", "frequency_penalty", "min_p", "repetition_penalty", "logit_bias", "logprobs",
                 "top_logprobs", "prompt_logprobs"}


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise InvalidField("echo", "echo is not supported by pagedkv")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidField("best_of", "best_of is not supported by pagedkv (leave it unset or equal to n)")
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
        return prompts


class ChatMessage(ToolMessageFields):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text: a string, or the text parts of a content list (other parts are refused)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidField("messages", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def wanted_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict[str, Any]]:
        return [{"role": m.role, "content": m.text(), **m.tool_keys()} for m in self.messages]


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
    message = first.get("msg", "invalid request")
    if param:
        message = f"{param}: {message}"
    return error_body(message, param=param, code=400)


def _is_type_name(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "list[int]", "list[str]", "list[list[int]]"} or (
        "[" in part or part.startswith("function-")
    )
