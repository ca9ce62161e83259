"""Constrained requests waiting for their grammar (vLLM's "waiting for FSM"), outside the scheduler.

A constrained request's sequences wait here, status ``COMPILING``, holding no blocks, while a compile worker
works; at the start of each step the ones whose grammar is ready get a matcher each and their first mask is
begun off the step loop (``mask_ahead``: a grammar's first mask can take seconds); once it is ready they
join the scheduler's waiting queue. The ones whose grammar failed end with an error (that request alone).
When nothing else can run the step waits briefly for a compile or a mask instead of spinning.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait

from pagedkv.core.errors import RequestRejected
from pagedkv.core.sample.grammar_backend import CompiledGrammar
from pagedkv.core.sample.grammar_compiler import result_of
from pagedkv.core.sample.mask_ahead import MaskAhead
from pagedkv.core.sample.reasoning_gate import gated
from pagedkv.core.sched.scheduler_interface import Scheduler
from pagedkv.core.sched.sequence import Sequence, SequenceStatus

IDLE_WAIT_S = 0.05  # at most this long per step when only compiles are pending (new requests get their turn)
FIRST_MASK_GRACE_S = 0.002  # a cheap first mask is waited for (it joins this step); a slow one is not


class GrammarGate:
    def __init__(self, masks: MaskAhead | None = None) -> None:
        self._masks = masks
        # request id -> (its compile, its sequences)
        self._parked: dict[str, tuple[Future[CompiledGrammar], list[Sequence]]] = {}
        self._priming: dict[str, list[Sequence]] = {}  # compiled, first masks being computed

    def __bool__(self) -> bool:
        return bool(self._parked or self._priming)

    def __len__(self) -> int:
        return len(self._parked) + len(self._priming)

    def park(self, request_id: str, future: Future[CompiledGrammar], seqs: list[Sequence]) -> None:
        for seq in seqs:
            seq.status = SequenceStatus.COMPILING
        self._parked[request_id] = (future, seqs)

    def discard(self, request_id: str) -> None:
        """The request was aborted while compiling."""
        self._parked.pop(request_id, None)
        self._priming.pop(request_id, None)

    def release(self, scheduler: Scheduler, idle: bool) -> None:
        """Move every request whose compile and first masks are done to ``scheduler`` (or fail it); with
        ``idle`` (nothing else to run) first wait a little for one to finish."""
        if idle:
            self._wait(IDLE_WAIT_S)
        started = []
        for request_id, (future, seqs) in list(self._parked.items()):
            if not future.done():
                continue
            del self._parked[request_id]
            try:
                grammar = result_of(future)
                matchers = [grammar.matcher() for _ in seqs]
            except Exception as exc:  # noqa: BLE001 - a failed compile ends this request alone
                fault = exc if isinstance(exc, RequestRejected) else RuntimeError(f"{type(exc).__name__}: {exc}")
                for seq in seqs:
                    scheduler.fail(seq, fault)
                continue
            for seq, matcher in zip(seqs, matchers):
                structured = seq.params.structured  # (a thinking model's grammar starts after its reasoning)
                seq.matcher = gated(matcher, seq.prompt_token_ids, structured.reasoning_start,
                                    structured.reasoning_end) if structured is not None else matcher
            self._priming[request_id] = seqs
            started.extend(seqs)
        if self._masks is not None and started:
            self._masks.start(started, new=True)
            self._masks.settle(started, timeout=FIRST_MASK_GRACE_S)
        for request_id, seqs in list(self._priming.items()):
            if self._masks is None or self._masks.ready(seqs):
                del self._priming[request_id]
                for seq in seqs:
                    scheduler.add(seq)

    def _wait(self, timeout: float) -> None:
        compiles = [future for future, _ in self._parked.values()]
        if compiles and not self._priming:
            wait(compiles, timeout=timeout, return_when=FIRST_COMPLETED)
        elif self._priming and self._masks is not None:
            self._masks.wait(timeout, [s for seqs in self._priming.values() for s in seqs])
