"""``/v1/completions``: the request model; its prompt is text, token ids, or a list of either."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.core.sample.structured_output import StructuredOutputs
from pagedkv.serve.api.errors import InvalidField
from pagedkv.serve.api.generation import GenerationRequest

MAX_PROMPTS = 256  # prompts in one request (each runs as its own engine request)
UNSET_MAX_TOKENS = 16  # OpenAI's and vLLM's default for completions


class CompletionRequest(GenerationRequest):
    """A completions body as the batch runner takes it; :class:`ServedCompletionRequest` is engine serve's."""

    echoes_logprobs: ClassVar[bool] = False  # whether this body's runner puts the prompt's logprobs before the answer's

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=UNSET_MAX_TOKENS, ge=0)  # null also means 16; 0 only with echo
    echo: bool = False  # the prompt's text before the completion
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # e.g. BOS before a text prompt (vLLM's default for completions)
    prompt_embeds: Any = None

    def check_rules(self) -> None:
        super().check_rules()
        if self.max_tokens == 0 and not (self.echo and self.echoes_logprobs):
            raise InvalidField("max_tokens", "max_tokens must be at least 1 (0 is allowed only with echo on "
                               "engine serve: the prompt alone comes back)")
        if not self.echoes_logprobs and self.echo and (self.logprobs is not None or self.prompt_logprobs is not None):
            raise InvalidField("echo", "echo together with logprobs is not supported in batch files")
        if self.suffix:
            raise InvalidField("suffix", "suffix is not supported by pagedkv")
        self.prompts()

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
        if len(prompts) > MAX_PROMPTS:
            raise InvalidField("prompt", f"prompt has {len(prompts)} prompts; at most {MAX_PROMPTS} are allowed")
        return prompts

    def wanted_max_tokens(self) -> int | None:
        return self.max_tokens if "max_tokens" in self.model_fields_set else None

    def unset_max_tokens(self, configured: int | None) -> int | None:
        return UNSET_MAX_TOKENS  # OpenAI's default, whatever the generation config says


class ServedCompletionRequest(CompletionRequest):
    """engine serve's completions body: with ``echo``, ``logprobs`` cover the prompt's tokens first (from the
    engine's prompt logprobs, the first one ``null``), and ``max_tokens: 0`` answers the prompt alone, as
    vLLM's server does (lm-eval's loglikelihood requests are exactly this)."""

    echoes_logprobs: ClassVar[bool] = True

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the engine still samples one token (it has to run the prompt), which
        the answer leaves out."""
        return self.echo and self.max_tokens == 0

    def wanted_max_tokens(self) -> int | None:
        return 1 if self.echo_only else super().wanted_max_tokens()

    def to_sampling_params(self, max_tokens: int, vocab_size: int | None = None,
                           defaults: dict[str, Any] | None = None,
                           structured: StructuredOutputs | None = None) -> SamplingParams:
        params = super().to_sampling_params(max_tokens, vocab_size, defaults, structured)
        if self.echo and params.logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = params.logprobs  # the echoed prompt's logprobs (same bound as logprobs)
        return params
