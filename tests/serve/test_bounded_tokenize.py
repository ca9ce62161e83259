"""Tokenizing in growing prefixes: exact ids for a text that fits, early refusal (bounded work) for one that cannot."""

from __future__ import annotations

import random

import pytest

from pagedkv.serve.http.bounded_tokenize import TooManyTokens, tokenize_bounded
from pagedkv.serve.testing import byte_level_tokenizer

WORDS = ["The", "capital", "of", "France", "is", "Paris.", "dragon", "tokens", "\n", "한국어", "aaaaaaaa", "!!"]


class Counting:
    """The tokenizer, counting the characters it is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.chars = tokenizer, 0

    def __call__(self, text, **kwargs):
        self.chars += len(text)
        return self.tokenizer(text, **kwargs)


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


def test_a_text_that_fits_gets_exactly_the_tokenizers_ids_and_one_that_does_not_is_refused(tokenizer):
    rng = random.Random(0)
    refused = fitted = 0
    for trial in range(60):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4000)))
        limit = rng.choice([256, 512, 1024, 4096])
        whole = tokenizer(text)["input_ids"]
        try:
            ids = tokenize_bounded(tokenizer, text, limit)
        except TooManyTokens as exc:
            assert len(whole) > limit and exc.tokens <= len(whole), (trial, len(whole), limit)
            refused += 1
        else:
            assert ids == list(whole)
            fitted += 1
    assert refused and fitted


def test_the_work_on_a_huge_text_is_bounded_by_the_context_not_the_text(tokenizer):
    counting = Counting(tokenizer)
    text = "The capital of France is Paris. " * 30_000  # ~1M characters
    with pytest.raises(TooManyTokens):
        tokenize_bounded(counting, text, 512)
    assert counting.chars <= 512 * 4 * 5, counting.chars
    no_spaces = "x" * 1_000_000
    counting.chars = 0
    with pytest.raises(TooManyTokens):
        tokenize_bounded(counting, no_spaces, 512)
    assert counting.chars <= 512 * 4 * 5
