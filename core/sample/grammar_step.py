"""The grammar's part of one step: allowed-token masks before sampling, matchers advanced after.

Only rows of constrained sequences are touched; every other row's logits and token are exactly those of
a batch without constraints. A matcher that fails (while filling its mask, or on a token) is that
sequence's fault alone, reported to the caller.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pagedkv.core.sample.grammar_backend import GrammarBackend, new_bitmask
from pagedkv.core.sample.mask_ahead import MaskAhead
from pagedkv.core.sample.reasoning_gate import masking

if TYPE_CHECKING:  # type hints only: this room sits below sched/
    from pagedkv.core.sched.sequence import Sequence


def allowed_masks(seqs: list[Sequence], backend: GrammarBackend | None, vocab_size: int,
                  fault: Callable[[Sequence, str, Exception], None],
                  ahead: MaskAhead | None = None) -> list[torch.Tensor | None]:
    """Per sequence: its packed mask row, or None if unconstrained (or failed: ``fault`` was called). Rows
    ``ahead`` computed already are taken from it; the others are filled now, in one batch, timed for it."""
    allowed: list[torch.Tensor | None] = [None] * len(seqs)
    rows = [i for i, seq in enumerate(seqs) if masking(seq.matcher) is not None]  # (none while reasoning)
    if not rows or backend is None:
        return allowed
    if ahead is not None:
        rows = ahead.take(seqs, rows, allowed, fault, vocab_size)
        if not rows:
            return allowed
    start = time.perf_counter()
    _fill(seqs, rows, backend, vocab_size, fault, allowed)
    if ahead is not None:
        ahead.note([seqs[i] for i in rows], time.perf_counter() - start)
    return allowed


def _fill(seqs: list[Sequence], rows: list[int], backend: GrammarBackend, vocab_size: int,
          fault: Callable[[Sequence, str, Exception], None], allowed: list[torch.Tensor | None]) -> None:
    bitmask = new_bitmask(len(rows), vocab_size)
    matchers = [masking(seqs[i].matcher) for i in rows]
    try:
        backend.fill_bitmask(matchers, bitmask)
    except Exception:  # noqa: BLE001 - find the failing matchers: each alone
        for j, i in enumerate(rows):
            try:
                backend.fill_bitmask([matchers[j]], bitmask[j : j + 1])
            except Exception as row_exc:  # noqa: BLE001
                fault(seqs[i], "the grammar", row_exc)
    for j, i in enumerate(rows):
        allowed[i] = bitmask[j]


def advance_matchers(seqs: list[Sequence], tokens: list[int], skip: dict[Sequence, Exception],
                     fault: Callable[[Sequence, str, Exception], None]) -> None:
    """Each constrained sequence's matcher consumes its sampled token (``skip``: already failed this step)."""
    for seq, token in zip(seqs, tokens):
        if seq.matcher is None or seq in skip:
            continue
        try:
            seq.matcher.consume(token)
        except Exception as exc:  # noqa: BLE001 - this request's grammar, not the others'
            fault(seq, "the grammar", exc)
