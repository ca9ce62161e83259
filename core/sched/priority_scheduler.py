"""Priority scheduling (vLLM's ``--scheduling-policy priority``): lower ``priority`` runs first.

The waiting queue is kept in (priority, arrival) order, so a request is admitted before every
request of a larger priority value and, among equals, in arrival order; a sequence preempted by
recompute goes back to its place in that order. When blocks run out, the victim is the running
sequence with the largest (priority, arrival) among those not yet scheduled in this step.
Everything else (chunked prefill, swap, the token budget) is FCFS's.
"""

from __future__ import annotations

import itertools
from bisect import insort

from pagedkv.core.events import EventLog
from pagedkv.core.kv.allocator_interface import Allocator
from pagedkv.core.kv.swap_space import SwapSpace
from pagedkv.core.sched.scheduler import FCFSScheduler
from pagedkv.core.sched.scheduler_interface import SchedulerHooks, SchedulingLimits
from pagedkv.core.sched.sequence import Sequence, SequenceStatus
from pagedkv.core.sched.stop_check import StopCheck


def _order(seq: Sequence) -> tuple[int, int]:
    return (seq.priority, seq.arrival)


class PriorityScheduler(FCFSScheduler):
    name = "priority"
    uses_priority = True  # the engine accepts a non-zero request priority only with such a scheduler

    def __init__(
        self, config: SchedulingLimits, allocator: Allocator, events: EventLog | None = None,
        hooks: SchedulerHooks | None = None, *, stop_check: StopCheck | None = None,
        swap_space: SwapSpace | None = None,
    ) -> None:
        super().__init__(config, allocator, events, hooks, stop_check=stop_check, swap_space=swap_space)
        self._arrivals = itertools.count()

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.arrival = next(self._arrivals)
        insort(self.waiting, seq, key=_order)

    def _requeue(self, seq: Sequence) -> None:
        insort(self.waiting, seq, key=_order)

    def _pop_victim(self, first: int) -> Sequence:
        running = self.running
        worst = max(range(first, len(running)), key=lambda i: _order(running[i]))
        return running.pop(worst)

