"""``/v1/completions``: the request model; its prompt is text, token ids, or a list of either."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from pagedkv.serve.api.errors import InvalidField
from pagedkv.serve.api.generation import GenerationRequest

MAX_PROMPTS = 256  # prompts in one request (each runs as its own engine request)
UNSET_MAX_TOKENS = 16  # OpenAI's and vLLM's default for completions


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=UNSET_MAX_TOKENS, ge=1)  # null also means 16
    echo: bool = False  # the prompt's text before the completion
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # e.g. BOS before a text prompt (vLLM's default for completions)
    prompt_embeds: Any = None

    def check_rules(self) -> None:
        super().check_rules()
        if self.echo and (self.logprobs is not None or self.prompt_logprobs is not None):
            raise InvalidField("echo", "echo together with logprobs is not supported by pagedkv")
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
