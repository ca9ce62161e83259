"""Taking the steps that only move the decode lane without the engine's step machinery.

When every running sequence rides the lane (nothing prefilling, swapped or failed, no
allocator plugins) and the free blocks are too few to admit the head of the queue
(:meth:`SimEngine.admission_floor`), the coming step does nothing but move the lane:
members decode, some cross into a new block (handed out in running order, as the real
step does; where they do not fit and no plugin chooses how, the newest sequences are
preempted as the real step preempts them), some may finish. Such steps are taken here,
up to the next arrival or the first step whose crossings would leave room enough to admit:
a quiet stretch (nothing crosses) in one move (long ones through
:mod:`~pagedkv.sim.quiet_run`), a step with crossings by :meth:`SimEngine.cross`, and
one on which members finish (or fill a watched block) by :meth:`SimEngine.cross_to_events`,
which leaves the finishing and reporting to the engine's own step. Whatever may admit or
swap in is left to ``engine.step``.
"""

from __future__ import annotations

from typing import Any

from pagedkv.sim.quiet_run import quiet_run
from pagedkv.sim.tally import RunTally

SHORT_GAP = 8  # quiet stretches up to this long are counted step by step (cheaper than the numpy jump)


def run_lane(engine: Any, tally: RunTally, arrival: float | None, arrival_step: int | None) -> None:
    """Take every step ahead that only moves the lane, stopping before the step at whose start the next
    request arrives (``arrival`` in simulated seconds, or ``arrival_step`` on a step clock)."""
    floor = engine.admission_floor()
    if floor is None:  # outside the lane's steady state, only a quiet stretch after a quiet step can be jumped
        quiet = engine.quiet_steps()
        if arrival_step is not None:
            quiet = min(quiet, arrival_step - tally.step)
        if quiet > 0:
            _jump(engine, tally, quiet, arrival)
        return
    lane, pool = engine.lane, engine.pool
    preempts = engine.lane_preempts()
    while True:
        if arrival is not None and tally.now >= arrival or arrival_step is not None and tally.step >= arrival_step:
            return
        free = pool.num_available
        gap = lane.next_event() - lane.clock - 1  # (members always have an event: their last step)
        if gap > 0:
            if free >= floor:
                return  # the next step admits
            if arrival_step is not None:
                gap = min(gap, arrival_step - tally.step)
            if gap > SHORT_GAP:
                if not _jump(engine, tally, gap, arrival):
                    return
                continue
            members, tokens, used, steps = len(lane.members), lane.tokens(), pool.num_used, 0
            while steps < gap and (arrival is None or tally.now < arrival):
                tally.lane_step(members, tokens, used, tokens + members)
                tokens += members
                steps += 1
            engine.skip(steps, checked=True)
            continue
        due = lane.due_crossings()
        preempting = len(due) > free
        if preempting and not preempts or not preempting and free - len(due) >= floor:
            return  # a plugin decides the preemption, or the step admits
        if lane.events_next():  # members finish or fill a block: the engine's step completes it
            outs = engine.cross_to_events(due)
            tally.real_step(engine, engine.runner.last, outs)
        else:
            members, context = engine.cross(due)
            tally.lane_step(members, context, pool.num_used, lane.tokens())
            if not preempting:
                continue
        floor = engine.admission_floor()  # the queue's head, the lane or the pool changed
        if floor is None:
            return


def _jump(engine: Any, tally: RunTally, quiet: int, arrival: float | None) -> int:
    """Up to ``quiet`` quiet steps in one move, cut before an ``arrival``; returns how many were taken."""
    jump = quiet_run(engine, tally.step_time, quiet, tally.now, arrival)
    steps = len(jump.t)
    if steps:
        engine.skip(steps, checked=True)
        tally.jump(jump, len(engine.scheduler.running), engine.pool.num_used)
    return steps
