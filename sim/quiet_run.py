"""The simulator's clock over a run of quiet steps, as the one-by-one loop would have moved it.

``run_once`` asks its :class:`~pagedkv.sim.sim_engine.SimEngine` how many steps from now
are quiet (only the decode lane moves) and takes them in one move; this module computes what
those steps add to the clock and the run's sums, bit for bit as step-by-step accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv.sim.step_time_model import StepTimeModel


@dataclass
class QuietRun:
    """The clock over a run of quiet steps, computed as the one-by-one loop would, step by step.

    Every quiet step has the same shape (no prefill, ``decodes`` lane members, each one token
    further); ``t`` holds the clock after each step. The sums use sequential accumulation
    (``numpy.cumsum``), so every float comes out bit for bit as the one-by-one loop's.
    """

    t: Any  # numpy float64 array
    dts: Any
    running: int
    held0: int  # tokens held after the last real step
    slots: int  # used blocks * block size

    def running_time(self, start: float) -> float:
        return float(_accumulate(start, self.running * self.dts))

    def waste(self, start: float) -> float:
        if not self.slots:
            return start
        held = self.held0 + self.running * np.arange(1, len(self.t) + 1, dtype=np.int64)
        return float(_accumulate(start, 1.0 - held / self.slots))


def _accumulate(start: float, values: Any) -> float:
    return np.cumsum(np.concatenate(([start], values)))[-1]


def quiet_run(engine: Any, step_time: StepTimeModel, steps: int, now: float, arrival: float | None) -> QuietRun:
    """Up to ``steps`` quiet steps from ``now``, cut before the step at whose start ``arrival`` is due."""
    lane = engine.lane
    members = len(lane.members)
    context = lane.tokens() + members * np.arange(steps, dtype=np.int64)  # KV each step's decodes read
    dts = step_time.step_seconds(0, members, context)
    t = np.cumsum(np.concatenate(([now], dts)))
    if arrival is not None:  # the one-by-one loop adds a request before the first step starting at/after it
        steps = int(np.searchsorted(t[:-1], arrival, side="left"))
    slots = engine.pool.num_used * engine.config.block_size
    return QuietRun(t[1 : steps + 1], dts[:steps], len(engine.scheduler.running), engine.tokens_held(), slots)
