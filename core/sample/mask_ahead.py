"""Grammar masks computed ahead, off the step loop, for the sequences whose masks are slow.

A grammar can make one mask cost 0.1-2 s (a 0.4 MB literal): computed inside the step, like every other
mask, it stretched every other request's step by as much. So a sequence whose last mask took longer than
``SLOW_MASK_S`` (and every new one, until its first mask is timed) has its next mask computed on a worker
thread as soon as its token is booked, and is *held* (``Sequence.held``: the scheduler skips it) until
that mask is ready; the step never waits for it. Cheap masks stay in the step's one batched fill, which
is faster than a thread hop. llguidance computes a mask without the GIL, so the step runs on meanwhile;
the workers run at a lower OS priority (``background_priority``) so they do not take the step's core either.

Only one thread touches a matcher at a time: a mask is started after the step's bookkeeping (the stop
check reads the matcher) and is taken before the matcher consumes the next token or is copied for a fork.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import torch

from pagedkv.core.sample.background_priority import lower_this_thread
from pagedkv.core.sample.grammar_backend import GrammarBackend, GrammarMatcher, bitmask_words, new_bitmask
from pagedkv.core.sample.reasoning_gate import masking

if TYPE_CHECKING:  # type hints only: this room sits below sched/
    from pagedkv.core.sched.sequence import Sequence

SLOW_MASK_S = 0.002  # a mask slower than this is computed ahead next time
TRUST_MASKS = 32  # a sequence timed cheap alone is not suspected for this many batched masks
WORKERS = 2
Fault = Callable[["Sequence", str, Exception], None]
Masked = tuple[torch.Tensor, float]  # (the mask row, seconds it took)


class MaskAhead:
    """``backend()`` is the grammar backend once built (None before); ``vocab_size`` the masks' width."""

    def __init__(self, backend: Callable[[], GrammarBackend | None], vocab_size: int, workers: int = WORKERS) -> None:
        self._backend = backend
        self._vocab_size = vocab_size
        self._workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: dict[Sequence, Future[Masked]] = {}  # a sequence's next mask, being computed or ready
        self._slow: set[Sequence] = set()  # sequences whose next mask is computed ahead
        self._cleared: dict[Sequence, int] = {}  # timed cheap alone: batched masks left before a new check
        self.computed = 0  # masks computed ahead

    def __bool__(self) -> bool:
        return bool(self._ahead)

    def start(self, seqs: Iterable[Sequence], new: bool = False) -> None:
        """Begin the next mask of each slow (or, with ``new``, each fresh) constrained sequence in ``seqs``."""
        backend = self._backend()
        if backend is None:
            return
        for seq in seqs:
            matcher = masking(seq.matcher)  # (none while a thinking model still reasons: nothing to mask)
            if matcher is None or seq.is_finished or seq in self._ahead or not (new or seq in self._slow):
                continue
            self._slow.add(seq)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="pagedkv-mask",
                                                initializer=lower_this_thread)
            self._ahead[seq] = self._pool.submit(_one_mask, backend, matcher, self._vocab_size)
            self.computed += 1

    def hold(self) -> int:
        """Mark each sequence whose mask is still being computed as held (and forget finished ones); how many."""
        held = 0
        for seq, future in list(self._ahead.items()):
            if seq.is_finished:
                del self._ahead[seq]
                continue
            seq.held = not future.done()
            held += seq.held
        self._forget_finished()
        return held

    def _forget_finished(self) -> None:
        self._slow = {seq for seq in self._slow if not seq.is_finished}
        self._cleared = {seq: n for seq, n in self._cleared.items() if not seq.is_finished}

    def ready(self, seqs: Iterable[Sequence]) -> bool:
        return all(seq not in self._ahead or self._ahead[seq].done() for seq in seqs)

    def wait(self, timeout: float, seqs: Iterable[Sequence] | None = None) -> None:
        """Wait up to ``timeout`` for one mask (of ``seqs``, or any) to be ready."""
        pending = [f for s, f in self._ahead.items() if not f.done() and (seqs is None or s in seqs)]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def settle(self, seqs: Iterable[Sequence], timeout: float | None = None) -> None:
        """Wait (up to ``timeout``) for the masks of ``seqs`` (about to sample, or to be forked: the matcher
        must be free)."""
        pending = [self._ahead[s] for s in seqs if s in self._ahead]
        if pending:
            wait(pending, timeout=timeout)

    def take(self, seqs: list[Sequence], rows: list[int], allowed: list[torch.Tensor | None], fault: Fault,
             vocab_size: int) -> list[int]:
        """Fill ``allowed[i]`` for the rows whose mask was computed ahead; the rows left for the step's fill
        (``vocab_size``: the logits' width, which the masks computed from now on take)."""
        self._vocab_size = vocab_size
        left = []
        for i in rows:
            seq = seqs[i]
            future = self._ahead.pop(seq, None)
            if future is None:
                left.append(i)
                continue
            seq.held = False  # (a scheduler that does not read ``held`` ran it anyway: the mask is waited for)
            try:
                row, seconds = future.result()
            except Exception as exc:  # noqa: BLE001 - this request's grammar, not the others'
                fault(seq, "the grammar", exc)
                continue
            if row.shape[0] != bitmask_words(vocab_size):
                left.append(i)  # computed for another width (the first ones, before any logits were seen)
                continue
            allowed[i] = row
            if seconds <= SLOW_MASK_S:  # cheap (timed alone): back to the step's batched fill, trusted a while
                self._slow.discard(seq)
                self._cleared[seq] = TRUST_MASKS
        return left

    def note(self, seqs: Iterable[Sequence], seconds: float) -> None:
        """The step's batched fill of ``seqs`` took ``seconds``. If slow, the suspects (those not timed cheap
        alone lately) have their next masks computed ahead, each timed alone; a batch slow only for its
        many cheap rows marks nobody, so they are not bounced off the batch every other step."""
        seqs = list(seqs)
        if len(self._slow) + len(self._cleared) > 2 * len(seqs) + 64:  # finished ones, while none was ahead
            self._forget_finished()
        if seconds > SLOW_MASK_S:
            self._slow.update(seq for seq in seqs if seq not in self._cleared)
        for seq in seqs:
            trust = self._cleared.pop(seq, 0) - 1
            if trust > 0:
                self._cleared[seq] = trust

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _one_mask(backend: GrammarBackend, matcher: GrammarMatcher, vocab_size: int) -> Masked:
    row = new_bitmask(1, vocab_size)
    start = time.perf_counter()
    backend.fill_bitmask([matcher], row)
    return row[0], time.perf_counter() - start
