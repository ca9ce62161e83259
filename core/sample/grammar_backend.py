"""The contract between the engine and a grammar backend (llguidance built in; xgrammar or others as plugins).

A backend plugin implements ``pagedkv_register_grammar_backends(register)`` and calls
``register(name, factory, description)``; ``factory(tokenizer, vocab_size, eos_token_ids)`` returns a
:class:`GrammarBackend`. The engine builds the backend the first time a constrained request arrives,
on a compile worker thread, so a backend's heavy import and tokenizer preparation never run on the step loop.

Masks are the common packed form (llguidance's and xgrammar's): an int32 tensor ``[rows, ceil(vocab / 32)]``
where bit ``j`` of word ``i`` set means token ``32 * i + j`` may come next.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import Protocol

import torch

from pagedkv.core.sample.structured_output import StructuredOutputs


class GrammarError(ValueError):
    """A constraint the backend cannot compile (the message says why), or a token its matcher refused."""


class GrammarMatcher(Protocol):
    """One sequence's position in its grammar; it sees every token the sequence samples, in order."""

    def consume(self, token: int) -> None:
        """Advance past ``token``; raise :class:`GrammarError` if the grammar does not allow it."""

    def is_terminated(self) -> bool:
        """True once the grammar has accepted and nothing but end-of-sequence may follow."""

    def copy(self) -> GrammarMatcher:
        """An independent matcher in the same state (a forked sample goes on from its parent's)."""


class CompiledGrammar(Protocol):
    """A constraint ready to match; shared by every request with an equal constraint. It may carry an
    ``nbytes`` int, its memory, which the compiled-grammar cache counts against its byte budget (without
    one the cache estimates from the constraint's size, see ``grammar_compiler``)."""

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""


class GrammarBackend(Protocol):
    """Compiles constraints and fills allowed-token masks for one tokenizer."""

    def compile(self, constraint: StructuredOutputs) -> CompiledGrammar:
        """Compile ``constraint``; raise :class:`GrammarError` with a one-line reason if it cannot be."""

    def fill_bitmask(self, matchers: SequenceOf[GrammarMatcher], bitmask: torch.Tensor) -> None:
        """Write row ``i`` of ``bitmask`` (int32 ``[len(matchers), words]``) with the tokens ``matchers[i]``
        allows next; a matcher that fails raises :class:`GrammarError` naming its index (``index`` attribute)."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed packed mask (every bit set)."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)
