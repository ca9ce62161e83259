"""The fields completions and chat share (sampling, streaming, vLLM's extras, structured outputs), and what they become.

Every field is checked when the body is parsed, so a bad one answers 400 naming it before any work
is queued. Types are strict (``"5"``, ``true`` and ``5.0`` are not the integer 5; an integer is a
number), ``null`` means "not set", and an unknown field is refused by name: a misspelt ``max_token``
must not silently run with the default length. ``check_rules`` holds the rules between fields; it
runs as the model's last validator, and each endpoint's model adds its own.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator

from pagedkv.core.errors import RequestRejected
from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.core.sample.structured_output import StructuredOutputs
from pagedkv.serve.api.errors import InvalidField
from pagedkv.serve.api.sampling import MAX_LOGIT_BIAS_ENTRIES, SAMPLING_DEFAULTS, sampling_extras, stop_strings
from pagedkv.serve.api.strict_body import StrictBody
from pagedkv.serve.api.structured import StructuredFields
from pagedkv.serve.api.tools import ToolChoice, combined_constraint
from pagedkv.serve.api.vllm import VllmFields

_EXTRA_FIELDS = {"presence_penalty", "frequency_penalty", "min_p", "repetition_penalty", "logit_bias", "logprobs",
                 "top_logprobs", "prompt_logprobs"}
_LOGPROB_FIELDS = ("logprobs", "top_logprobs", "prompt_logprobs")


class StreamOptions(StrictBody):
    include_usage: bool = True  # vLLM's default when stream_options is given
    continuous_usage_stats: bool = False  # usage (so far) on every chunk, with include_usage


class GenerationRequest(VllmFields, StructuredFields):
    """Fields shared by /v1/completions and /v1/chat/completions.

    ``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` left unset take the
    model's generation config (``--generation-config auto``), else OpenAI's defaults, as vLLM.
    """

    chat: ClassVar[bool] = False  # OpenAI's two logprobs shapes differ

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
        return stop_strings(value)

    @field_validator("logit_bias")
    @classmethod
    def _bias_is_bounded(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias has {len(value)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed")
        return value

    @model_validator(mode="after")
    def _rules(self) -> GenerationRequest:
        self.check_rules()  # InvalidField is not a ValueError: pydantic lets it through unchanged
        return self

    def check_rules(self) -> None:
        """The rules between fields, and fields with an OpenAI meaning pagedkv does not implement (a 400 beats
        a silently different answer)."""
        self.check_vllm_fields()
        if self.stream and self.prompt_logprobs is not None:
            raise InvalidField("prompt_logprobs", "prompt_logprobs is not supported with stream: true")
        if self.stream_options is not None and not self.stream:
            raise InvalidField("stream_options", "stream_options is only allowed when stream is true")

    def check_limits(self, max_logprobs: int, uses_priority: bool) -> None:
        """The server's own limits: ``--max-logprobs``, and ``priority`` only under the priority policy."""
        if self.priority and not uses_priority:
            raise InvalidField("priority", f"priority {self.priority} needs priority scheduling; start the server "
                               "with --scheduling-policy priority")
        for name in _LOGPROB_FIELDS:
            value = getattr(self, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > max_logprobs:
                raise InvalidField(name, f"{name} ({value}) is above this server's --max-logprobs ({max_logprobs})")

    def wanted_max_tokens(self) -> int | None:
        """The answer length the client asked for (None: not set)."""
        return self.max_tokens

    def max_tokens_field(self) -> str:
        return "max_tokens"

    def unset_max_tokens(self, configured: int | None) -> int | None:
        """The answer length when the client set none: the generation config's (``max_new_tokens``), if any."""
        return configured

    def max_tokens_for(self, prompt_tokens: int, context: int, configured: int | None = None) -> int:
        """The answer's budget: the length asked for, which must fit beside the prompt, else the endpoint's
        default cut to the room the prompt leaves."""
        wanted = self.wanted_max_tokens()
        if wanted is None:
            return min(self.unset_max_tokens(configured) or context, context - prompt_tokens)
        if prompt_tokens + wanted > context:
            raise InvalidField(self.max_tokens_field(), f"max_tokens ({wanted}) + the prompt ({prompt_tokens} "
                               f"tokens) is above this model's context of {context} tokens")
        return wanted

    def max_tokens_or(self, default: int) -> int:
        """A batch line's budget: the length asked for, else the run's ``--max-tokens`` (the engine checks it
        against the context)."""
        wanted = self.wanted_max_tokens()
        return default if wanted is None else wanted

    def constraint(self, choice: ToolChoice | None = None, tools: list[dict[str, Any]] | None = None,
                   allow_additional_properties: bool = False) -> tuple[StructuredOutputs | None, str | None]:
        """(the output constraint, the field it came from): the body's own, or a forced tool choice's; JSON
        schemas closed to unlisted keys unless ``allow_additional_properties``."""
        structured, field = self.structured(allow_additional_properties)
        return combined_constraint(structured, field, choice, tools or [], allow_additional_properties)

    def to_sampling_params(self, max_tokens: int, vocab_size: int | None = None,
                           defaults: dict[str, Any] | None = None,
                           structured: StructuredOutputs | None = None) -> SamplingParams:
        """The engine's sampling parameters; ``defaults``: values for the fields this request left unset."""
        if self.min_tokens > max_tokens:
            raise InvalidField("min_tokens", f"min_tokens ({self.min_tokens}) is above max_tokens ({max_tokens})")
        fields = self.model_dump(include=_EXTRA_FIELDS)
        chosen = {}
        for name, fallback in SAMPLING_DEFAULTS.items():
            value = getattr(self, name)
            chosen[name] = value if value is not None else (defaults or {}).get(name, fallback)
        fields["min_p"], fields["repetition_penalty"] = chosen.pop("min_p"), chosen.pop("repetition_penalty")
        extras = sampling_extras(fields, self.chat, vocab_size)
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=float(chosen["temperature"]), top_k=max(int(chosen["top_k"]), 0),
                top_p=float(chosen["top_p"]), seed=self.seed, n=self.n, stop=list(self.stop or []),
                ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, structured=structured, **extras,
                **self.vllm_sampling(),
            )
        except RequestRejected as exc:  # the engine's checks start their message with the field's name
            name = str(exc).split(" ", 1)[0]
            raise InvalidField(name if name in type(self).model_fields else None, str(exc)) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``: usage on every chunk (with ``include_usage``)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)
