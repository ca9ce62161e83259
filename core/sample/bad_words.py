"""vLLM's ``bad_words``: words a request must never generate, as token-id sequences the sampler bans.

A word names text and the sampler bans token ids, so each word is tokenized once per request
(``Engine.add_request``); at each step the token that would complete a word is banned.
"""

from __future__ import annotations

from typing import Any

from pagedkv.core.errors import RequestRejected


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
