"""Prompt inputs in vLLM's shapes.

``LLM.generate`` and ``Engine.add_request`` take a prompt as text, as token ids, or as vLLM's
``TextPrompt`` / ``TokensPrompt`` dicts (``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``).
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
