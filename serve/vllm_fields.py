"""vLLM's extra request fields, one definition for ``engine serve`` and batch files (``engine run --input``).

Both front ends read a body's vLLM fields here: which are refused by name (``REFUSED``), the
rules between them (``check``), and what they become (``sampling_kwargs``, ``engine_options``),
so the same field means the same in a batch line and in a request. ``KINDS`` gives the JSON
type of each, for the batch reader, which has no pydantic (``serve/protocol.py`` declares the
same types for the server; ``tests/test_one_validator.py`` checks that the two agree).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedkv.serve.api.errors import InvalidField

# Declared (so they are never silently dropped) but not implemented: a request that sets one answers
# 400 naming it. Structured outputs (structured_outputs, guided_*) are in structured_protocol.
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

# field -> (JSON kind, default); kinds: int, number, bool, str, int_list, str_list, any
KINDS: dict[str, tuple[str, Any]] = {
    "stop_token_ids": ("int_list", None), "include_stop_str_in_output": ("bool", False),
    "skip_special_tokens": ("bool", True), "spaces_between_special_tokens": ("bool", True),
    "bad_words": ("str_list", None), "allowed_token_ids": ("int_list", None),
    "truncate_prompt_tokens": ("int", None), "priority": ("int", 0), "cache_salt": ("str", None),
    "return_token_ids": ("bool", None), "request_id": ("str", None), "best_of": ("int", None),
    "use_beam_search": ("bool", False), "length_penalty": ("number", 1.0),
    **{name: ("any", None) for name in REFUSED if name not in ("prompt_embeds", "reasoning_effort")},
}


def check(value: Callable[[str], Any], n: int) -> None:
    """The rules on vLLM's fields beyond their types; ``value(name)`` is the field's value or default."""
    for name, why in REFUSED.items():
        if value(name) not in (None, False):
            raise InvalidField(name, why)
    if value("use_beam_search"):
        raise InvalidField("use_beam_search", "beam search is not supported by pagedkv")
    if value("best_of") is not None and value("best_of") != n:
        raise InvalidField("best_of", "best_of is not supported by pagedkv (leave it unset or equal to n)")
    if value("length_penalty") != 1.0:
        raise InvalidField("length_penalty", "length_penalty applies to beam search, which pagedkv does not do")
    if value("cache_salt") is not None and not value("cache_salt"):
        raise InvalidField("cache_salt", "cache_salt must be a non-empty string")
    truncate = value("truncate_prompt_tokens")
    if truncate is not None and truncate < -1:
        raise InvalidField("truncate_prompt_tokens", "truncate_prompt_tokens must be >= -1")
    if truncate == 0:
        raise InvalidField("truncate_prompt_tokens", "truncate_prompt_tokens must be >= 1 (or -1)")
    if value("allowed_token_ids") is not None and not value("allowed_token_ids"):
        raise InvalidField("allowed_token_ids", "allowed_token_ids must not be empty")


def sampling_kwargs(value: Callable[[str], Any]) -> dict[str, Any]:
    """The vLLM fields that are ``SamplingParams`` fields, as keyword arguments."""
    return {
        "stop_token_ids": list(value("stop_token_ids") or []),
        "include_stop_str_in_output": value("include_stop_str_in_output"),
        "skip_special_tokens": value("skip_special_tokens"),
        "spaces_between_special_tokens": value("spaces_between_special_tokens"),
        "bad_words": list(value("bad_words") or []),
        "allowed_token_ids": value("allowed_token_ids"),
        "truncate_prompt_tokens": value("truncate_prompt_tokens"),
    }


def engine_options(value: Callable[[str], Any]) -> dict[str, Any]:
    """What ``Engine.add_request`` takes besides the prompt and sampling parameters."""
    options: dict[str, Any] = {}
    if value("cache_salt") is not None:
        options["cache_salt"] = value("cache_salt")
    if value("priority"):
        options["priority"] = value("priority")
    return options


def reader(body: dict[str, Any]) -> Callable[[str], Any]:
    """``value(name)`` for a JSON body: the field, or its default when absent or null."""

    def value(name: str) -> Any:
        found = body.get(name)
        return KINDS.get(name, ("any", None))[1] if found is None else found

    return value
