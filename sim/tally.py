"""A simulated run's clock and running figures, added up step by step in one fixed order.

The driver moves a :class:`~pagedkv.sim.sim_engine.SimEngine` three ways: a real
``step``, a lane step taken without the engine's step machinery (only decode-lane members
moved, some into a new block), and a run of quiet steps jumped over in one move. Each adds
to the same sums here with the same float operations in the same order (the jump through
``numpy.cumsum``, which accumulates sequentially), so every figure of the report is what
taking every step for real would give, bit for bit.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable
from typing import Any

from pagedkv.sim.quiet_run import QuietRun
from pagedkv.sim.step_time_model import StepTimeModel

PROGRESS_EVERY = 512  # steps between progress reports


class RunTally:
    def __init__(self, step_time: StepTimeModel, block_size: int, prompt_len: dict[str, int], series: bool,
                 progress: Callable[[int, int], None] | None, total: int) -> None:
        self.step_time = step_time
        self.block_size = block_size
        self.prompt_len = prompt_len  # request id -> prompt length (a scheduled item past it is a decode)
        self.series = series
        self.progress = progress
        self.total = total  # requests in the workload (for progress)
        self.now = 0.0  # simulated seconds
        self.step = 0
        self.running_sum = self.running_time = self.usage_sum = self.waste_sum = 0.0
        self.waste_steps = 0
        self.peak_running = 0
        self.first_token: dict[str, float] = {}
        self.finished: dict[str, float] = {}
        self.t_used = array("d")
        self.used_series = array("i")

    def real_step(self, engine: Any, out: Any, outs: list) -> None:
        """``engine.step`` ran ``out`` (its scheduler output) and returned ``outs``."""
        prompt_len = self.prompt_len
        prefill, decodes, context = 0, getattr(out, "lane_decodes", 0), getattr(out, "lane_context", 0)
        for item in out.scheduled:
            ctx = item.context_len
            if item.num_new_tokens == 1 and ctx >= prompt_len[item.seq.request_id]:
                decodes += 1
                context += ctx
            else:
                prefill += item.num_new_tokens
        dt = self.step_time.step_seconds(prefill, decodes, context)
        self.now = now = self.now + dt
        first_token = self.first_token
        for item in out.scheduled:  # (after the step, so ``item.samples`` no longer holds)
            rid = item.seq.request_id
            if rid not in first_token and item.context_len + item.num_new_tokens >= prompt_len[rid]:
                first_token[rid] = now
        for o in outs:
            self.finished[o.request_id] = now
        used = engine.pool.num_used
        self._count(dt, len(engine.scheduler.running), used, engine.tokens_held() if used else 0)

    def lane_step(self, members: int, context: int, used: int, held: int) -> None:
        """A step in which only the lane's ``members`` decoded (their KV ``context`` before it), with
        ``used`` blocks and ``held`` tokens after it: the figures a real step of that shape adds."""
        dt = self.step_time.step_seconds(0, members, context)
        self.now += dt
        self._count(dt, members, used, held)

    def _count(self, dt: float, running: int, used: int, held: int) -> None:
        self.step = step = self.step + 1
        self.peak_running = max(self.peak_running, running)
        self.running_sum += running
        self.running_time += running * dt
        self.usage_sum += used
        if used:
            self.waste_sum += 1.0 - held / (used * self.block_size)
            self.waste_steps += 1
        if self.series:
            self.t_used.append(self.now)
            self.used_series.append(used)
        if self.progress is not None and not step % PROGRESS_EVERY:
            self.progress(len(self.finished), self.total)

    def jump(self, run: QuietRun, running: int, used: int) -> None:
        """The quiet steps of ``run`` were skipped (``running`` sequences, ``used`` blocks throughout)."""
        steps = len(run.t)
        if self.progress is not None and (self.step + steps) // PROGRESS_EVERY > self.step // PROGRESS_EVERY:
            self.progress(len(self.finished), self.total)
        self.step += steps
        self.now = float(run.t[-1])
        self.running_sum += running * steps
        self.usage_sum += used * steps
        self.running_time, self.waste_sum = run.running_time(self.running_time), run.waste(self.waste_sum)
        self.waste_steps += steps if used else 0
        if self.series:
            self.t_used.frombytes(run.t.tobytes())
            self.used_series.extend(itertools.repeat(used, steps))
