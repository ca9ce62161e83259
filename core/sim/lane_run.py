"""Taking the steps that only move the decode lane without the engine's step machinery.

When every running sequence rides the lane (nothing prefilling, swapped or failed, no
allocator plugins) and the waiting queue cannot be admitted, the coming steps do nothing
but move the lane: members decode, some cross into a new block, until one of them finishes
or fills a watched block, a request arrives, the crossings no longer fit in the free pool
(a preemption may follow) or the pool has room enough to admit (see
:meth:`SimEngine.lane_steps_ahead`). Quiet stretches (no crossing) are jumped over in one move
(:mod:`~pagedkv.core.sim.quiet_run`); a step with crossings is taken directly
(:meth:`SimEngine.cross`): its blocks handed out in running order, as the real step would.
The first step that may do more is left to ``engine.step``.
"""

from __future__ import annotations

from typing import Any

from pagedkv.core.sim.quiet_run import quiet_run
from pagedkv.core.sim.tally import RunTally

SHORT_GAP = 8  # quiet stretches up to this long are taken step by step (cheaper than the numpy jump)


def run_lane(engine: Any, tally: RunTally, arrival: float | None, arrival_step: int | None) -> None:
    """Take every step ahead that only moves the lane, stopping before the step at whose start the next
    request arrives (``arrival`` in simulated seconds, or ``arrival_step`` on a step clock)."""
    lane, pool, running = engine.lane, engine.pool, engine.scheduler.running
    while True:
        quiet = engine.quiet_steps()
        if arrival_step is not None:
            quiet = min(quiet, arrival_step - tally.step)
        if arrival is not None and tally.now >= arrival or arrival_step is not None and tally.step >= arrival_step:
            return
        if quiet > SHORT_GAP:
            jump = quiet_run(engine, tally.step_time, quiet, tally.now, arrival)
            if not len(jump.t):
                return
            engine.skip(len(jump.t))
            tally.jump(jump, len(running), pool.num_used)
            continue
        if quiet > 0:
            members, context = len(lane.members), lane.tokens()
            engine.skip(1)
            tally.lane_step(members, context, pool.num_used, engine.tokens_held())
            continue
        due = engine.crossing_step()
        if due is None:
            return
        members, context = len(lane.members), lane.tokens()
        engine.cross(due)
        tally.lane_step(members, context, pool.num_used, engine.tokens_held())
