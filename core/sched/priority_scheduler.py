"""Priority scheduling (vLLM's ``--scheduling-policy priority``): lower ``priority`` runs first, with aging.

Every sequence has a *rank*, fixed when its request is queued: ``priority * A + s``, where ``s`` is the
scheduler step it arrived at and ``A`` is ``priority_aging_steps`` (EngineConfig; default 100). Lower
rank runs first, ties in arrival order. So a newcomer of priority ``p'`` overtakes a waiting request of
priority ``p > p'`` only while that one has waited fewer than ``(p - p') * A`` steps: waiting ``A``
steps is worth one priority level, and no stream of better-priority requests starves a request forever
(vLLM has no aging: ``A = 0`` here is its strict (priority, arrival) order). The rank is fixed at
arrival, so the queue stays sorted by insertion and a sequence preempted by recompute goes back to its
old place. When blocks run out, the victim is the running sequence of the largest rank among those not
yet scheduled in this step. Everything else (chunked prefill, swap, the token budget) is FCFS's.

When a server's waiting queue is full, :meth:`PriorityScheduler.eviction_candidates` names the waiting
sequences a newcomer of a strictly better priority may push out (by priority alone: aging orders the
queue, it does not make a request harder to evict).
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

DEFAULT_AGING_STEPS = 100  # EngineConfig.priority_aging_steps: steps of waiting worth one priority level


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
        # a limits object without the field (a plugin's or a test's) gets the default
        self.aging_steps: int = getattr(config, "priority_aging_steps", DEFAULT_AGING_STEPS)

    def rank(self, seq: Sequence) -> tuple[int, int]:
        """The sequence's place in the queue, lower first (see the module docstring)."""
        if self.aging_steps:
            return (seq.priority * self.aging_steps + seq.arrival_step, seq.arrival)
        return (seq.priority, seq.arrival)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.arrival = next(self._arrivals)
        seq.arrival_step = self.step_index
        insort(self.waiting, seq, key=self.rank)

    def _requeue(self, seq: Sequence) -> None:
        insort(self.waiting, seq, key=self.rank)

    def _pop_victim(self, first: int) -> Sequence:
        running = self.running
        worst = max(range(first, len(running)), key=lambda i: self.rank(running[i]))
        return running.pop(worst)

    def eviction_candidates(self, priority: int) -> list[Sequence]:
        """Waiting sequences that never ran and whose priority is strictly worse than ``priority``,
        the one to evict first first: the worst priority, the newest among equals."""
        found = [s for s in self.waiting if s.priority > priority and not s.num_preemptions and not s.output_token_ids]
        found.sort(key=lambda s: (s.priority, s.arrival), reverse=True)
        return found
