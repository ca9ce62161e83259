"""vLLM's extra request fields (``extra_body`` in the OpenAI SDK), on both generation endpoints.

Every field of vLLM's own request models is declared, and each is either implemented with vLLM's
meaning or refused by name (``REFUSED``), never silently ignored (see docs/vllm_compat.md). The
structured-output fields are in ``structured.py``, the chat-template ones in ``chat.py``.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from pagedkv.core.sched.request_check import PRIORITY_MAX, PRIORITY_MIN
from pagedkv.serve.api.errors import InvalidField
from pagedkv.serve.api.strict_body import StrictBody

# Declared (so they are never silently dropped) but not implemented: a request that sets one answers
# 400 naming it. Structured outputs (structured_outputs, guided_*) are in structured.py.

REFUSED = {
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


class VllmFields(StrictBody):
    """vLLM's sampling and extra parameters shared by both endpoints."""

    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    priority: int = Field(default=0, ge=PRIORITY_MIN, le=PRIORITY_MAX)
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

    def check_vllm_fields(self) -> None:
        """The rules on vLLM's fields beyond their types."""
        for name, why in REFUSED.items():
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

    def truncated(self, prompts: list[list[int]], context: int) -> list[list[int]]:
        """vLLM's ``truncate_prompt_tokens``: each prompt's last k tokens (-1: as many as the context holds)."""
        if self.truncate_prompt_tokens is None:
            return prompts
        keep = context if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        return [p[-keep:] for p in prompts]
