"""The step's CPU threads sized, while serving, to the cores other processes leave free.

Why: a decode step is a chain of parallel regions, each ending in a barrier. When another process holds
one of two cores, one of the step's two threads is descheduled for whole time slices and the other waits
for it at every barrier: throughput fell to 0.15-0.42x of quiet on the 2-core machine (issue 43). One
thread has no barriers to wait at, and with the neighbour on the other core it keeps a full core.
``openmp_env`` makes the waits sleep when the machine is already busy at start-up; this follows load that
comes and goes afterwards, as vLLM's CPU backend sizes its OpenMP pool to the cores it is given.

How: every ``window_s`` seconds (between steps, on the engine thread) the machine's busy CPU time and this
process's own are read (``/proc/stat``, ``/proc/self/stat``: same clock ticks); what others used, in cores,
is ``busy - own``. The step gets the cores left, rounded generously (``others`` of 0.3 still leaves 2 of
2; a neighbour that takes 0.6 of a core leaves 1), never more than the configured count and never fewer
than one. A new count is applied only after ``confirm`` windows agree, so one noisy window changes nothing.
Where ``/proc`` cannot be read (not Linux) the count stays as configured.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

SLACK = 0.35  # cores of others' load still rounded away (a shell, a monitoring agent)


@dataclass(frozen=True)
class CpuSample:
    """Cumulative clock ticks: the machine's busy and total time summed over its CPUs, this process's own
    (user + system) time, and the number of CPUs ``/proc/stat`` lists."""

    busy: int
    total: int
    own: int
    cpus: int


def read_cpu_sample(stat_path: str = "/proc/stat", self_path: str = "/proc/self/stat") -> CpuSample | None:
    """The counters now, or None where they cannot be read."""
    try:
        with open(stat_path) as f:
            lines = f.read().splitlines()
        with open(self_path) as f:
            own_fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return parse_cpu_sample(lines, own_fields)


def parse_cpu_sample(stat_lines: list[str], own_fields: list[str]) -> CpuSample | None:
    """``/proc/stat``'s lines and the fields of ``/proc/self/stat`` after the command name, as a sample."""
    total_line = next((line.split() for line in stat_lines if line.startswith("cpu ")), None)
    if total_line is None or len(total_line) < 5 or len(own_fields) < 13:
        return None
    ticks = [int(v) for v in total_line[1:9]]  # user nice system idle iowait irq softirq steal
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    cpus = sum(1 for line in stat_lines if line.startswith("cpu") and line[3:4].isdigit())
    # fields after ")": state is [0], so utime and stime (fields 14 and 15 of the whole line) are [11], [12]
    own = int(own_fields[11]) + int(own_fields[12])
    return CpuSample(busy=sum(ticks) - idle, total=sum(ticks), own=own, cpus=max(1, cpus))


def others_cores(before: CpuSample, after: CpuSample) -> float | None:
    """The cores other processes kept busy between two samples (None when no time passed)."""
    total = after.total - before.total
    if total <= 0:
        return None
    cores = after.cpus * (after.busy - before.busy) / total
    own = after.cpus * (after.own - before.own) / total
    return max(0.0, cores - own)


def threads_for(others: float, usable: int, max_threads: int) -> int:
    """The step's threads when others keep ``others`` cores busy out of the ``usable`` ones."""
    free = usable - others
    return max(1, min(max_threads, math.floor(free + SLACK)))


class ThreadShare:
    """Call :meth:`tick` between steps on the thread that runs them; it calls ``set_threads`` (on that
    thread) when the share it measures changes. ``sample`` and ``clock`` are injectable for tests."""

    def __init__(self, max_threads: int, set_threads: Callable[[int], None], usable: int | None = None,
                 sample: Callable[[], CpuSample | None] = read_cpu_sample,
                 clock: Callable[[], float] = time.monotonic, window_s: float = 1.0, confirm: int = 2) -> None:
        self.max_threads = max(1, max_threads)
        self.usable = usable if usable is not None else usable_cpus()
        self.threads = self.max_threads
        self._set_threads = set_threads
        self._sample = sample
        self._clock = clock
        self._window_s = window_s
        self._confirm = max(1, confirm)
        self._last = sample()
        self._last_time = clock()
        self._proposal: tuple[int, int] | None = None  # (threads, windows in a row that asked for them)
        self.changes = 0

    def tick(self) -> None:
        now = self._clock()
        if self._last is None or now - self._last_time < self._window_s:
            return
        current = self._sample()
        others = others_cores(self._last, current) if current is not None else None
        self._last, self._last_time = current, now
        if others is None:
            return
        wanted = threads_for(others, self.usable, self.max_threads)
        if wanted == self.threads:
            self._proposal = None
            return
        count = self._proposal[1] + 1 if self._proposal and self._proposal[0] == wanted else 1
        self._proposal = (wanted, count)
        if count >= self._confirm:
            self._set_threads(wanted)
            self.threads, self._proposal = wanted, None
            self.changes += 1


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
