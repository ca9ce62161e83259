"""Tokenizing a client's text with work bounded by the context, not by the text's length.

A text can be hundreds of thousands of characters and still pass the character check
(``admission.max_prompt_chars`` must allow the longest tokens). Tokenizing it whole
takes seconds that a text which cannot fit does not deserve, so the text is tokenized
in growing prefixes (4x each time, cut at whitespace): as soon as a prefix alone needs
more than the context (plus a margin for the one word the cut may split), the text is
refused; a text that fits is tokenized whole once the prefix reaches its end, so the
ids are exactly the tokenizer's. The work is at most a few times that of a prompt that
fills the context.
"""

from __future__ import annotations

from typing import Any

MARGIN_TOKENS = 64  # allowance for the one word a cut may split (its tokens can differ from the whole word's)
FIRST_PROBE_CHARS_PER_TOKEN = 4


class TooManyTokens(ValueError):
    """The text needs more tokens than ``limit`` (``tokens`` is a lower bound)."""

    def __init__(self, tokens: int) -> None:
        super().__init__(f"at least {tokens} tokens")
        self.tokens = tokens


def tokenize_bounded(tokenizer: Any, text: str, limit: int, add_special_tokens: bool = True) -> list[int]:
    """``tokenizer(text)``'s ids, or :class:`TooManyTokens` once a prefix shows the text needs over ``limit``."""
    size = max(1024, limit * FIRST_PROBE_CHARS_PER_TOKEN)
    while size < len(text):
        cut = _cut(text, size)
        ids = tokenizer(text[:cut], add_special_tokens=add_special_tokens)["input_ids"]
        if len(ids) > limit + MARGIN_TOKENS:
            raise TooManyTokens(len(ids) - MARGIN_TOKENS)
        size *= 4
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def _cut(text: str, size: int) -> int:
    """A prefix length near ``size`` that ends at whitespace when there is some close by."""
    space = max(text.rfind(" ", size - 1024, size), text.rfind("\n", size - 1024, size))
    return space if space > 0 else size
