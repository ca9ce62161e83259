"""The built-in grammar backend, on llguidance (``pip install 'pagedkv[structured]'``): JSON schemas, any JSON
object, regular expressions, choices and Lark (or GBNF) grammars.

llguidance is imported by the factory, which the engine calls on its compile thread when the first
constrained request arrives; nothing here runs while no request is constrained. A compiled grammar keeps
one matcher at its start and hands out copies of it (a copy shares the compiled grammar), and masks for a
whole step are filled by llguidance's own thread pool, outside the GIL.
"""

from __future__ import annotations

import json
from collections.abc import Sequence as SequenceOf
from typing import Any

import torch

from pagedkv.core.hookspecs import hookimpl
from pagedkv.core.sample.grammar_backend import GrammarError, new_bitmask
from pagedkv.core.sample.structured_output import StructuredOutputs

NAME = "guidance"


@hookimpl
def pagedkv_register_grammar_backends(register: Any) -> None:
    register(NAME, GuidanceBackend, "llguidance: JSON schema, regex, choice and Lark grammars (pagedkv[structured])")


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "the grammar failed"


def guidance_tokenizer(llguidance: Any, tokenizer: Any, vocab_size: int, eos: list[int] | None) -> Any:
    """llguidance's tokenizer: from pagedkv's FastTokenizer's own JSON (transformers never imported: ~120 MiB
    of RSS and seconds on the first constrained request, benchmarks/JOURNAL.md), else from a transformers one."""
    tokenizers_json = getattr(tokenizer, "tokenizers_json", None)
    if callable(tokenizers_json):
        return llguidance.LLTokenizer(tokenizers_json(), n_vocab=vocab_size,
                                      eos_token=eos if eos is not None else tokenizer.eos_token_id)
    import llguidance.hf  # (imports transformers)

    hf_tokenizer = getattr(tokenizer, "transformers_tokenizer", tokenizer)  # (a wrapper may hand one over)
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)


class GuidanceMatcher:
    __slots__ = ("inner",)

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def consume(self, token: int) -> None:
        if not self.inner.consume_token(token):
            raise GrammarError(_first_line(self.inner.get_error()))

    def is_terminated(self) -> bool:
        return self.inner.is_stopped()

    def copy(self) -> GuidanceMatcher:
        return GuidanceMatcher(self.inner.deep_copy())


class GuidanceGrammar:
    def __init__(self, start: Any) -> None:
        self._start = start  # a matcher at the grammar's start, never advanced

    def matcher(self) -> GuidanceMatcher:
        return GuidanceMatcher(self._start.deep_copy())


class GuidanceBackend:
    """``tokenizer`` must be a fast Hugging Face tokenizer; the EOS ids are the ones the grammar may end on."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Any) -> None:
        try:
            import llguidance  # (not llguidance.torch: it runs torch.compile at import, seconds of start-up)
        except ImportError as exc:
            raise GrammarError("structured outputs need llguidance: pip install 'pagedkv[structured]'") from exc
        self._ll = llguidance
        eos = sorted(eos_token_ids) or None
        if eos is None and getattr(tokenizer, "eos_token_id", None) is None:
            raise GrammarError("structured outputs need an end-of-sequence token, and this model has none")
        try:
            self.tokenizer = guidance_tokenizer(llguidance, tokenizer, vocab_size, eos)
        except ValueError as exc:
            raise GrammarError(f"llguidance cannot use this tokenizer: {exc}") from exc
        self.executor = llguidance.LLExecutor()
        self.vocab_size = vocab_size

    def grammar_text(self, constraint: StructuredOutputs) -> str:
        """The constraint in llguidance's grammar form."""
        matcher = self._ll.LLMatcher
        kind = constraint.kind
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else constraint.json
            options = {"whitespace_flexible": not constraint.disable_any_whitespace}
            try:
                return matcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
            except ValueError as exc:
                raise GrammarError(_first_line(str(exc))) from None
        if kind == "regex":
            return matcher.grammar_from_regex(constraint.regex)
        if kind == "choice":
            # one terminal, so the lexer's automaton holds the choices: as rule alternatives each is a parser
            # item, and llguidance's parser refuses a row of more than 2,000 items in the middle of a stream
            return matcher.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c)
                                                                                  for c in constraint.choice))
        try:
            return self._ll.grammar_from("grammar", constraint.grammar)  # Lark, or GBNF converted to it
        except ValueError as exc:
            raise GrammarError(_first_line(str(exc))) from None

    def compile(self, constraint: StructuredOutputs) -> GuidanceGrammar:
        text = self.grammar_text(constraint)
        error = self._ll.LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            raise GrammarError(_first_line(error))
        start = self._ll.LLMatcher(self.tokenizer, text, log_level=0)
        if start.is_error():
            raise GrammarError(_first_line(start.get_error()))
        self._first_step(start.deep_copy())
        return GuidanceGrammar(start)

    def _first_step(self, probe: Any) -> None:
        """One mask and one token on a copy of the start: a grammar that admits no text (``[^\\s\\S]``, a
        ``$ref`` loop) or whose forced text never ends (``start: "a" start``) fails here, as the client's
        mistake, not on the step loop as a server error."""
        mask = new_bitmask(1, self.vocab_size)
        probe.unsafe_compute_mask_ptr(mask.data_ptr(), mask.shape[1] * 4)
        words = mask[0].nonzero()
        if probe.is_error() or not len(words):
            reason = _first_line(probe.get_error()) if probe.is_error() else "no token is allowed"
            raise GrammarError(f"the constraint admits no text ({reason})")
        word = int(words[0])
        bits = int(mask[0, word]) & 0xFFFFFFFF
        token = word * 32 + (bits & -bits).bit_length() - 1
        if not probe.consume_token(token):
            raise GrammarError(f"the constraint admits no finite text ({_first_line(probe.get_error())})")

    def fill_bitmask(self, matchers: SequenceOf[GuidanceMatcher], bitmask: torch.Tensor) -> None:
        if bitmask.dtype != torch.int32 or not bitmask.is_cpu or not bitmask.is_contiguous():
            raise ValueError("the bitmask must be a contiguous int32 CPU tensor")
        row_bytes = bitmask.shape[1] * 4
        if len(matchers) == 1:
            matchers[0].inner.unsafe_compute_mask_ptr(bitmask.data_ptr(), row_bytes)
        else:
            self.executor.unsafe_compute_mask_ptr([(m.inner, i) for i, m in enumerate(matchers)],
                                                  bitmask.data_ptr(), row_bytes, bitmask.shape[0])
        for i, m in enumerate(matchers):
            if m.inner.is_error():
                error = GrammarError(_first_line(m.inner.get_error()))
                error.index = i  # type: ignore[attr-defined]
                raise error
