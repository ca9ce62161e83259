"""A grammar that starts after the model's reasoning (vLLM's structured outputs with a reasoning parser).

A thinking model writes ``<think> ... </think>`` before its answer; a schema, a regex or a forced tool
call constrains only the answer. :class:`AfterReasoning` wraps a sequence's matcher: until the tokens of
the reasoning's end marker have been sampled it lets every token through and feeds its grammar nothing,
then it is the grammar. Whether the reasoning already ended in the prompt (a template that closes it, as
with ``enable_thinking: false``) is read from the prompt's last marker, start or end.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

from pagedkv.core.sample.grammar_backend import GrammarMatcher


def _last_end(ids: SequenceOf[int], marker: tuple[int, ...]) -> int:
    """Where the last occurrence of ``marker`` in ``ids`` ends (-1: none). The search runs in C
    (``list.index`` on the reversed ids); only the hits of the marker's last token are compared."""
    if not marker:
        return -1
    backwards, size, pos = list(ids)[::-1], len(marker), 0
    while True:
        try:
            j = backwards.index(marker[-1], pos)
        except ValueError:
            return -1
        end = len(backwards) - j
        if end >= size and tuple(ids[end - size:end]) == marker:
            return end
        pos = j + 1


def ended_in(ids: SequenceOf[int], start: tuple[int, ...], end: tuple[int, ...]) -> bool:
    """Whether the last reasoning marker in ``ids`` is the end one (a later start marker reopens it)."""
    last_end = _last_end(ids, end)
    return last_end >= 0 and last_end > _last_end(ids, start)


class AfterReasoning:
    """A matcher whose grammar applies only after the ``end`` marker's tokens (see the module doc)."""

    def __init__(self, inner: GrammarMatcher, end: tuple[int, ...], ended: bool = False,
                 tail: tuple[int, ...] = ()) -> None:
        self.inner = inner
        self.end = end
        self.ended = ended
        self.tail = tail  # the last tokens sampled while reasoning (as many as the marker has)

    def consume(self, token: int) -> None:
        if self.ended:
            self.inner.consume(token)
            return
        self.tail = (*self.tail, token)[-len(self.end):]
        self.ended = self.tail == self.end

    def is_terminated(self) -> bool:
        return self.ended and self.inner.is_terminated()

    def copy(self) -> AfterReasoning:
        return AfterReasoning(self.inner.copy(), self.end, self.ended, self.tail)


def masking(matcher: GrammarMatcher | None) -> GrammarMatcher | None:
    """The matcher that masks this step's tokens: None while its reasoning goes on (every token allowed)."""
    if isinstance(matcher, AfterReasoning):
        return matcher.inner if matcher.ended else None
    return matcher


def gated(matcher: GrammarMatcher, prompt: SequenceOf[int], start: tuple[int, ...],
          end: tuple[int, ...]) -> GrammarMatcher:
    """``matcher`` behind the reasoning (unchanged without an ``end`` marker)."""
    if not end:
        return matcher
    return AfterReasoning(matcher, end, ended_in(prompt, start, end))
