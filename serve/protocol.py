"""OpenAI request bodies (pydantic) and the error bodies the server answers with.

Every field is checked here, so a bad one answers 400 naming it before any work is
queued. Types are strict (``"5"``, ``true`` and ``5.0`` are not the integer 5; an integer
is a number), ``null`` means "not set", and an unknown field is refused by name: a
misspelt ``max_token`` must not silently run with the default length. Every field of vLLM's
own request models is declared here and either implemented with vLLM's meaning or refused by
name (``vllm_fields.REFUSED``), never silently ignored (see docs/vllm_compat.md). The structured-output and
tool fields are declared in ``structured_protocol``. The penalty, bias and logprob fields go through
``sampling_fields`` (shared with batch files).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.serve import chat_fields, vllm_fields
from pagedkv.serve import request_rules as rules
from pagedkv.serve.api.errors import InvalidField
from pagedkv.serve.sampling_fields import sampling_extras
from pagedkv.serve.strict_body import StrictBody
from pagedkv.serve.structured_protocol import StructuredFields, ToolFields, ToolMessageFields


class StreamOptions(StrictBody):
    include_usage: bool = True  # vLLM's default when stream_options is given
    continuous_usage_stats: bool = False  # usage (so far) on every chunk, with include_usage


# --- vLLM's fields (issue 26): each implemented with vLLM's meaning, or refused by name -------------

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

    def _vllm_value(self, name: str) -> Any:
        return getattr(self, name, None)

    def refuse_vllm_unsupported(self) -> None:
        vllm_fields.check(self._vllm_value, getattr(self, "n", 1))

    def vllm_sampling(self) -> dict[str, Any]:
        """The vLLM fields that are ``SamplingParams`` fields, as keyword arguments."""
        return vllm_fields.sampling_kwargs(self._vllm_value)

    def engine_options(self) -> dict[str, Any]:
        """What ``Engine.add_request`` takes besides the prompt and sampling parameters."""
        return vllm_fields.engine_options(self._vllm_value)


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
        except InvalidField as exc:
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
        extras = sampling_extras(fields, isinstance(self, ChatCompletionRequest), vocab_size)
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
        return chat_fields.for_template(self.role, self.text(), self.name, self.tool_call_id, self.tool_calls)

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        try:
            rules.content_text(value)
        except InvalidField as exc:
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
        chat_fields.check(self._vllm_value, "add_generation_prompt" in self.model_fields_set)

    def template_arguments(self) -> dict[str, Any]:
        """Keyword arguments for ``tokenizer.apply_chat_template`` (besides the conversation)."""
        return chat_fields.template_arguments(self._vllm_value)

    def echo_text(self) -> str:
        """vLLM's chat ``echo``: the last message's text, when it is the assistant's (the answer's role)."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    def wanted_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]
