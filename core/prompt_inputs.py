"""Prompt inputs in vLLM's shapes, and the token-id forms of request fields that name text.

``LLM.generate`` and ``Engine.add_request`` take a prompt as text, as token ids, or as vLLM's
``TextPrompt`` / ``TokensPrompt`` dicts (``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``).
``bad_words`` name text; the sampler bans token ids, so each word is tokenized once per request.
"""

from __future__ import annotations

from typing import Any

from pagedkv.core.errors import RequestRejected


def prompt_of(prompt: Any) -> str | list[int]:
    """Text or token ids from any accepted prompt shape; anything else is one clear error."""
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys == {"prompt_token_ids"} or keys == {"prompt_token_ids", "prompt"}:
            return list(prompt["prompt_token_ids"])
        if keys == {"prompt"}:
            return prompt["prompt"]
        raise RequestRejected("a prompt dict takes 'prompt' (text) or 'prompt_token_ids' (ids); got keys "
                              f"{sorted(keys)}")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):
        return list(prompt)
    raise RequestRejected(f"a prompt is text, a list of token ids or a prompt dict, got {type(prompt).__name__}")


def is_single_prompt(prompts: Any) -> bool:
    """True for one prompt (text, a dict, or one list of ids); False for a list of prompts."""
    return isinstance(prompts, (str, dict)) or bool(prompts) and isinstance(prompts[0], int)


def bad_word_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each bad word's token ids as written (left-stripped) and, where it tokenizes differently, after a
    space (mid-sentence): the sampler bans a word's last token once the tokens before it were generated."""
    if tokenizer is None:
        raise RequestRejected("bad_words needs a tokenizer")
    found: list[list[int]] = []
    for word in words:
        bare = list(tokenizer(word.lstrip(), add_special_tokens=False)["input_ids"])
        spaced = list(tokenizer(" " + word.lstrip(), add_special_tokens=False)["input_ids"])
        for ids in (bare, spaced):
            if ids and ids not in found:
                found.append(ids)
    return found


def bad_word_bans(words: list[list[int]], output: list[int]) -> list[int]:
    """The tokens that would complete a bad word after ``output``."""
    banned = []
    for ids in words:
        head = len(ids) - 1
        if head == 0 or (len(output) >= head and output[-head:] == ids[:-1]):
            banned.append(ids[-1])
    return banned
