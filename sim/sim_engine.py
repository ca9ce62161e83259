"""The simulator's engine: a real :class:`Engine` over a :class:`SimulatedRunner`, with the decode lane.

``SimEngine(config, runner=SimulatedRunner(shape))`` is ``Engine`` with the same
runner, plus, where it decides exactly as one-by-one stepping (no forks or
copy-on-write, no step-event listeners such as telemetry, FCFS's running loop and a
built-in allocator), a scheduler whose steady decodes ride a
:class:`~pagedkv.sim.decode_lane.DecodeLane`. It also lets its driver take the
steps that only move the lane without the step machinery (see
:mod:`~pagedkv.sim.lane_run`): quiet ones in one move (:meth:`quiet_steps`,
:meth:`skip`), and ones where members cross into new blocks (:meth:`cross`).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.core.invariants import check_invariants
from pagedkv.core.sched.scheduler import Sample
from pagedkv.core.sched.sequence import RequestOutput, Sequence
from pagedkv.core.step_sampling import sampling_rows
from pagedkv.sim.decode_lane import DecodeLane
from pagedkv.sim.lane_scheduler import lane_reproduces, with_decode_lane
from pagedkv.sim.simulated_runner import SimulatedRunner

# What RunStats.observe_step reads of a lane step that preempted nothing (scheduler.cross returns no output then).
_NOTHING_PREEMPTED = SimpleNamespace(preempted=())


class SimEngine(Engine):
    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        runner: SimulatedRunner,
        plugins: tuple[Any, ...] = (),
        decode_lane: bool = True,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._lane_wanted = decode_lane
        super().__init__(config, plugins=plugins, runner=runner, clock=clock)
        self.lane: DecodeLane | None = getattr(self.scheduler, "lane", None)

    def _scheduler_factory(self, entry: Any) -> Any:
        if self._lane_wanted and not (
            self._fork_hook or self._any_impl("pagedkv_copy_on_write", "pagedkv_on_step_events")
        ) and lane_reproduces(entry.factory, self.allocator):
            return with_decode_lane(entry.factory)
        return super()._scheduler_factory(entry)

    def step(self, stream: bool = True) -> list[RequestOutput]:
        """As :meth:`Engine.step`, without torch's inference mode (no model runs here)."""
        if stream and self.lane is not None and self.lane.members:
            self.lane.flush()  # a streaming step reports every sequence's new token: they must be exact
        return self._step(stream)

    def _sample(self, out: Any, logits: Any) -> list[Sample]:
        """Greedy over the runner's one-column logits is always its token: no tensor work for that
        (a runner built with ``logits=False`` gives only the row count; the rows are made if needed)."""
        seqs, rows = sampling_rows(out, self._fork)
        if all(s.params.greedy for s in seqs):
            return [(s, SimulatedRunner.TOKEN, None) for s in seqs]
        if isinstance(logits, int):
            logits = torch.zeros((logits, 1))
        return self.sampling.draw(seqs, rows, logits)

    def plugin_stats(self) -> dict[str, Any]:
        """As :meth:`Engine.plugin_stats`, with every sequence exact first (a plugin may read them)."""
        if self.lane is not None:
            self.lane.flush()
        return super().plugin_stats()

    def check_invariants(self) -> None:
        lane = self.lane
        if lane is not None:  # the lane merges by run_order: the running list must be sorted by it
            lane.flush()
            running = self.scheduler.running
            assert set(lane.outside) == set(running), "the decode lane lost track of a running sequence"
            assert [s.run_order for s in running] == sorted(s.run_order for s in running)
        check_invariants(self)

    # --- steps that only move the lane, taken without the step machinery (see lane_run) ----------------------

    def admission_floor(self) -> int | None:
        """Where every running sequence rides the lane (nothing prefilling, swapped or failed, no allocator
        plugins, the batch within the token budget): the fewest free blocks with which the next step would
        admit a waiting request (``num_blocks + 1`` if none however many are free). None elsewhere."""
        lane, sched = self.lane, self.scheduler
        if not (
            lane is not None and lane.members and not lane.outside and not sched.swapped and not sched.failed
            and len(lane.members) <= sched.max_num_batched_tokens and self.allocator.hooks is None
        ):
            return None
        floor = sched.admission_floor()
        return self.num_blocks + 1 if floor is None else floor

    def quiet_steps(self) -> int:
        """How many steps from now would only move the lane (0 if the next one might do more).

        Until a lane member's event (a block boundary, a full block, its last token) the pool and
        the queues do not change, so neither does any admission decision: after a quiet step (only
        the lane moved), or where the free blocks are below :meth:`admission_floor`, the steps up to
        that event are quiet. Requests added in between are the caller's to account for (it knows arrivals).
        """
        lane, sched = self.lane, self.scheduler
        if lane is None:
            return 0
        if sched.quiet:
            if lane.outside or sched.swapped or sched.failed:
                return 0
            if sched.waiting and self.allocator.hooks is not None:  # a prefix-cache lookup may have effects
                return 0
        else:
            floor = self.admission_floor()
            if floor is None or self.pool.num_available >= floor:
                return 0
        nxt = lane.next_event()
        return max(0, nxt - lane.clock - 1) if nxt is not None else 0

    def skip(self, steps: int, checked: bool = False) -> None:
        """Take ``steps`` quiet steps in one move: what ``steps`` calls of ``step(stream=False)`` would do.
        ``checked``: the caller made sure they are quiet (as :func:`~pagedkv.sim.lane_run.run_lane` does)."""
        if not checked and not 0 <= steps <= self.quiet_steps():
            raise ValueError(f"cannot skip {steps} steps: only {self.quiet_steps()} are quiet")
        if not steps:
            return
        lane, stats = self.lane, self.stats
        lane.skip(steps)
        self.scheduler.step_index += steps
        stats.steps += steps
        stats.generated_tokens += steps * len(lane.members)
        used = self.pool.num_used
        if used >= stats.peak_blocks_used:  # waste at a tied peak falls as tokens grow: the last step's is the min
            stats.observe_memory(used, self.tokens_held(), self.config.block_size, len(self.scheduler.running))

    def lane_preempts(self) -> bool:
        """A lane step may preempt without the step machinery: no plugin chooses how (swap or recompute)."""
        return self.scheduler.choose_preemption is None

    def cross_to_events(self, due: list[Sequence]) -> list[RequestOutput]:
        """As :meth:`cross`, on a step on which members also finish or fill a block: the lane scheduler
        decides the step and the engine's own step completes it (finishes, outputs, figures)."""
        return self._run_step(self.scheduler.cross(due, events=True), stream=False)

    def cross(self, due: list[Sequence]) -> tuple[int, int]:
        """The next step, in which only the lane moves and its members ``due`` (the lane's crossings for it)
        each take a new block, as ``step(stream=False)`` takes it. The caller checked that it is one: no
        member finishes or fills a block then, and either the blocks fit and fewer than :meth:`admission_floor`
        are left after them, or they do not fit and :meth:`lane_preempts`. Returns the step's decodes and
        their context (KV tokens read), for its duration."""
        out = self.scheduler.cross(due)
        lane = self.lane
        members = len(lane.members)
        self.stats.generated_tokens += members
        self.stats.observe_step(out if out is not None else _NOTHING_PREEMPTED, self.scheduler, self.pool.num_used,
                                self.tokens_held, self.config.block_size)
        return members, lane.tokens() - members
