"""The scheduler interface: what the engine calls on a scheduler, and what a scheduler calls outside itself.

Each step the engine asks :meth:`Scheduler.schedule` for the step (who runs, how many tokens each,
the block copies and swaps before the forward), runs it, samples, and hands the tokens back to
:meth:`Scheduler.update_from_output`, which books them (counters, full blocks, finishes). Between
steps it adds, forks, aborts and fails sequences. Telemetry, invariants and stats read the queues.

The engine builds the scheduler once, whole, with ``factory(config, allocator, events=...,
hooks=..., stop_check=..., swap_space=...)`` (:class:`SchedulerFactory`).
:class:`~pagedkv.core.sched.scheduler.FCFSScheduler` is the reference implementation; subclass
it to change one rule (the priority scheduler and ``examples/pagedkv-spf`` do).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pagedkv.core.events import EventLog
from pagedkv.core.kv.allocator_interface import Allocator
from pagedkv.core.kv.swap_space import SwapSpace
from pagedkv.core.sched.scheduler_output import Sample, SchedulerOutput, StepUpdate
from pagedkv.core.sched.sequence import Sequence
from pagedkv.core.sched.stop_check import StopCheck


class SchedulingLimits(Protocol):
    """The part of :class:`~pagedkv.core.config.EngineConfig` a scheduler reads."""

    max_num_seqs: int
    max_num_batched_tokens: int


class ChoosePreemption(Protocol):
    """``pagedkv_choose_preemption``: ``"swap"`` or ``"recompute"`` for a sequence about to be preempted."""

    def __call__(self, *, seq: Sequence, scheduler: Scheduler) -> str | None: ...


class BlockFull(Protocol):
    """``pagedkv_on_block_full``: block ``logical_index`` (physical ``block_id``) of ``seq`` is full."""

    def __call__(self, *, seq: Sequence, logical_index: int, block_id: int) -> object: ...


@dataclass(frozen=True)
class SchedulerHooks:
    """What a scheduler calls outside itself, each None when nobody listens."""

    choose_preemption: ChoosePreemption | None = None  # plugins' decision (a raise fails that sequence)
    on_block_full: BlockFull | None = None  # plugins' observers (a raising plugin is disabled)
    on_step_peak: Callable[[], None] | None = None  # the engine's KV-memory probe, at the step's peak


class Scheduler(Protocol):
    """A scheduler, as the engine and its readers (stats, telemetry, invariants) use it."""

    name: str
    uses_priority: bool  # honours ``Sequence.priority``: the engine refuses non-zero priorities otherwise
    allocator: Allocator
    waiting: deque[Sequence]
    running: list[Sequence]
    swapped: deque[Sequence]
    failed: list[Sequence]  # ended by a fault since the engine last reported them; the engine clears it
    tokens_discarded: int  # computed tokens thrown away by preemptions by recompute, over the run

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one joins the running queue (its blocks are shared already)."""

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take ``seq`` out of every queue and give back its blocks."""

    def fail(self, seq: Sequence, fault: Exception) -> None:
        """End ``seq`` with an error (finish reason ``"error"``) and list it in ``failed``."""

    def has_unfinished(self) -> bool:
        """True while any sequence waits, runs or is swapped out."""

    def eviction_candidates(self, priority: int) -> list[Sequence]:
        """Waiting sequences that never ran which a newcomer of ``priority`` may push out of a full queue,
        the first to evict first (empty for a scheduler without priorities)."""

    def schedule(self) -> SchedulerOutput:
        """Decide the next step."""

    def update_from_output(self, out: SchedulerOutput, samples: list[Sample]) -> StepUpdate:
        """Book the step ``out`` after the model ran and ``samples`` were drawn."""

    def computed_tokens(self) -> int:
        """Computed tokens over the running sequences."""


class SchedulerFactory(Protocol):
    """What ``pagedkv_register_schedulers`` registers (a class such as ``FCFSScheduler`` is one)."""

    def __call__(
        self, config: SchedulingLimits, allocator: Allocator, events: EventLog | None = None,
        hooks: SchedulerHooks | None = None, *, stop_check: StopCheck | None = None,
        swap_space: SwapSpace | None = None,
    ) -> Scheduler: ...
