"""When a sampled token ends a sequence: EOS, a stop token id, a complete grammar, a stop string, or its length."""

from __future__ import annotations

from typing import Any

from pagedkv.core.sample.bad_words import bad_word_bans
from pagedkv.core.sample.detokenizer import output_text
from pagedkv.core.sched.sequence import Sequence


class StopCheck:
    """The engine's end-of-sequence rule, given to the scheduler (which finishes sequences).

    ``eos_token_ids`` come from the model; ``tokenizer`` (optional) is needed for stop strings.
    """

    def __init__(self, eos_token_ids: frozenset[int] = frozenset(), tokenizer: Any = None) -> None:
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer

    def __call__(self, seq: Sequence, token: int) -> tuple[str, int | str | None] | None:
        """``(finish_reason, stop_reason)`` if ``token`` (already appended) ends ``seq``, else None.

        A stop string also trims ``seq.output_text`` to the text before it.
        """
        p = seq.params
        result: tuple[str, int | str | None] | None = None
        if not p.ignore_eos and token in self.eos_token_ids:
            result = ("stop", None)
        elif token in p.stop_token_ids:
            result = ("stop", token)
        elif seq.matcher is not None and seq.matcher.is_terminated():  # the grammar is complete: only EOS is left
            result = ("stop", None)
            seq.grammar_done = True  # its last token is part of the answer (see detokenizer.ends_by_token)
        elif (n_out := len(seq.output_token_ids)) >= p.max_tokens or len(seq.prompt_token_ids) + n_out >= seq.max_len:
            result = ("length", None)
        if p.stop and self.tokenizer is not None:
            by_token = result is not None and result[0] == "stop" and not seq.grammar_done
            text = output_text(seq, self.tokenizer, final=result is not None, drop_last=by_token)
            for s in p.stop:
                cut = text.find(s)
                if cut >= 0:
                    seq.output_text = text[:cut + len(s)] if p.include_stop_str_in_output else text[:cut]
                    return ("stop", s)
        return result

    def ends_by_length_only(self, seq: Sequence) -> bool:
        """True when no token can end ``seq`` early: its last step is known in advance."""
        p = seq.params
        return not (p.stop_token_ids or p.stop or self.eos_token_ids or p.structured)

    def banned(self, seq: Sequence) -> list[int]:
        """Token ids ``seq`` may not produce now: EOS and stop tokens before ``min_tokens``, and the token
        that would complete one of its ``bad_words``."""
        p = seq.params
        words = bad_word_bans(p.bad_words_token_ids, seq.output_token_ids) if p.bad_words_token_ids else []
        if len(seq.output_token_ids) >= p.min_tokens:
            return words
        return ([] if p.ignore_eos else list(self.eos_token_ids)) + list(p.stop_token_ids) + words


def eos_token_ids_of(model: Any, tokenizer: Any) -> frozenset[int]:
    """The model's end-of-sequence ids (generation config first, then model config, then tokenizer)."""
    if model is None:
        return frozenset()
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        ids.update(value if isinstance(value, (list, tuple)) else [value])
        break
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
