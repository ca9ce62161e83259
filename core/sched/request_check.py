"""Refusing a request that can never run, before it changes anything (one clear line saying why)."""

from __future__ import annotations

from pagedkv.core.errors import RequestRejected

# vLLM's ``priority`` is an unbounded int; here it is a signed 64-bit one, so no caller (a client through the
# server, or Python code) can make the scheduler order its queue by thousand-digit numbers, and every
# ordering a deployment needs still fits
PRIORITY_MIN, PRIORITY_MAX = -2**63, 2**63 - 1


def check_prompt(token_ids: list[int], vocab_size: int, max_model_len: int, num_blocks: int, block_size: int) -> None:
    """Raise :class:`RequestRejected` for an empty prompt, ids outside the vocabulary, or one too long."""
    if not token_ids:
        raise RequestRejected("the prompt is empty; give at least one token")
    plain_ints = set(map(type, token_ids)) == {int}  # C-speed check for the usual case
    if not plain_ints and not all(isinstance(t, int) for t in token_ids) or not (
        0 <= min(token_ids) and max(token_ids) < vocab_size
    ):
        raise RequestRejected(f"prompt token ids must be integers in 0..{vocab_size - 1}")
    if len(token_ids) > max_model_len:
        capacity = num_blocks * block_size
        if max_model_len == capacity:
            raise RequestRejected(
                f"the prompt has {len(token_ids)} tokens but the whole KV cache holds only "
                f"{capacity} ({num_blocks} blocks of {block_size}); give a larger KV budget or a shorter prompt"
            )
        raise RequestRejected(f"the prompt has {len(token_ids)} tokens, more than max_model_len={max_model_len}")


def check_text(text: str, what: str) -> None:
    """Raise :class:`RequestRejected` for a string that is not text (a lone UTF-16 surrogate cannot be encoded)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestRejected(f"{what} is not valid text: a lone surrogate at character {exc.start}") from None


def check_priority(priority: object) -> int:
    """``priority`` as an int in PRIORITY_MIN..PRIORITY_MAX; :class:`RequestRejected` naming it otherwise (bool too)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise RequestRejected(f"priority must be an integer, got {type(priority).__name__} {priority!r:.40}")
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise RequestRejected(f"priority must be a signed 64-bit integer ({PRIORITY_MIN}..{PRIORITY_MAX}); "
                              f"got one of {len(str(abs(priority)))} digits")
    return priority
