"""Incremental detokenization: the text of a growing token list, a few tokens decoded per step.

Decoding the whole output again after every token costs O(n) per token, O(n^2) per
request. Instead we keep a small window: ``prefix`` marks the tokens whose text is
already out, ``read`` the end of what was decoded last time. Each update decodes only
``ids[prefix:]`` and ``ids[prefix:read]``; their difference is the new text. Decoding
the window with a little left context (the ``prefix..read`` tokens) keeps tokenizers
that drop or add a leading space at the start of a decode (SentencePiece) consistent.

A byte-level tokenizer may split one character over several tokens; until the last
byte arrives the window decodes to a trailing U+FFFD. Such text is held back, so a
chunk never ends in a broken character. An output that ends inside a character (cut by
``max_tokens``) never shows its first bytes: they are dropped at the end, as vLLM does, so
no answer ends in U+FFFD; invalid bytes followed by more text still show as U+FFFD, as a
full decode would show them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # type hints only: this room sits below sched/
    from pagedkv.core.sched.sequence import Sequence

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """The decoded text of one sequence's output tokens, advanced a few tokens at a time."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # every complete character so far
        self._prefix = 0  # tokens before this index have their text in self.text (window's left context start)
        self._read = 0  # tokens before this index are decoded into self.text

    def _decode(self, ids: list[int]) -> str:
        if self.spaces_between_special_tokens:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=False)

    def update(self, token_ids: list[int], final: bool = False) -> str:
        """Take the sequence's full output token list (only its new tail is read); return the text so far.

        With ``final``, the text before an unfinished last character is let out; its bytes are not.
        """
        if len(token_ids) < len(self.token_ids):  # not an extension: start over (never happens in the engine)
            self.__init__(self.tokenizer, self.skip_special_tokens, self.spaces_between_special_tokens)
        self.token_ids.extend(token_ids[len(self.token_ids):])
        self.push((), final)
        return self.text

    def push(self, new_ids: Any, final: bool = False) -> str:
        """Append ``new_ids``; return only the text they completed (``""`` while a character is unfinished)."""
        self.token_ids.extend(new_ids)
        if self._read == len(self.token_ids):
            return ""
        window = self.token_ids[self._prefix:]
        known = self._decode(self.token_ids[self._prefix:self._read])
        full = self._decode(window)
        if final and full.endswith(_REPLACEMENT):  # nothing more will come: drop the unfinished character
            full = full.rstrip(_REPLACEMENT)
        if len(full) <= len(known) or (full.endswith(_REPLACEMENT) and not final):
            if final:  # nothing more will come: this is the end
                self._prefix = self._read = len(self.token_ids)
            return ""
        delta = full[len(known):]
        self._prefix, self._read = self._read, len(self.token_ids)
        self.text += delta
        return delta


def output_text(seq: Sequence, tokenizer: Any, final: bool = False, drop_last: bool | None = None) -> str:
    """``seq``'s output text so far, decoded incrementally by a detokenizer kept on the sequence.

    ``drop_last``: the last token ended the sequence (EOS or a stop token id) and, unless the request
    asked for ``include_stop_str_in_output``, its text is not part of the answer (vLLM's rule);
    None: whether ``seq`` finished so (:func:`ends_by_token`).
    """
    if drop_last is None:
        drop_last = ends_by_token(seq)
    if tokenizer is None:
        return ""
    detokenizer = seq.detokenizer
    params = seq.params
    if detokenizer is None:
        detokenizer = seq.detokenizer = IncrementalDetokenizer(
            tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens)
    ids = seq.output_token_ids
    if drop_last and not params.include_stop_str_in_output:
        ids = ids[:-1]
    return detokenizer.update(ids, final)


def ends_by_token(seq: Sequence) -> bool:
    """True when ``seq`` finished on a token (EOS or a stop token id), not a stop string, its length or a
    complete grammar (whose last token is text)."""
    return seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str) and not seq.grammar_done
