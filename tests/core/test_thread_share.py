"""The step's threads follow the cores other processes leave free (issue 43, item 5): measured from the
machine's and this process's CPU counters, applied only after two windows agree, never below one thread or
above the configured count, and a no-op where the counters cannot be read. Every reading here is injected:
nothing depends on what this machine is doing."""

from __future__ import annotations

import threading

import pytest
import torch

from pagedkv.core.thread_share import CpuSample, ThreadShare, others_cores, parse_cpu_sample, threads_for

STAT = """cpu  1000 10 500 8000 40 5 5 20 0 0
cpu0 500 5 250 4000 20 3 2 10 0 0
cpu1 500 5 250 4000 20 2 3 10 0 0
intr 123
ctxt 456
"""
# /proc/self/stat after "(python3)": state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
SELF = "S 1 1 1 0 -1 4194304 10 0 0 0 300 80 0 0 20 0 3 0".split()


def test_proc_stat_is_read_as_busy_total_own_and_cpus():
    sample = parse_cpu_sample(STAT.splitlines(), SELF)
    # busy = user nice system irq softirq steal = 1000+10+500+5+5+20; idle = idle + iowait = 8040
    assert sample == CpuSample(busy=1540, total=9580, own=380, cpus=2)


def test_unreadable_counters_give_no_sample():
    assert parse_cpu_sample(["intr 1"], SELF) is None
    assert parse_cpu_sample(STAT.splitlines(), ["S", "1"]) is None


def test_others_are_the_busy_cores_less_this_process():
    before = CpuSample(busy=0, total=0, own=0, cpus=2)
    # 1 s on 2 CPUs at 100 ticks/s: 200 ticks in all, 150 busy, 60 of them ours -> others kept 0.9 of a core
    after = CpuSample(busy=150, total=200, own=60, cpus=2)
    assert others_cores(before, after) == pytest.approx(0.9)
    assert others_cores(after, after) is None  # no time passed


@pytest.mark.parametrize(("others", "usable", "max_threads", "expected"), [
    (0.0, 2, 2, 2), (0.3, 2, 2, 2), (0.6, 2, 2, 1), (1.0, 2, 2, 1), (2.0, 2, 2, 1),
    (0.0, 8, 4, 4), (3.0, 8, 8, 5), (7.9, 8, 8, 1),
])
def test_the_step_gets_the_cores_others_leave(others, usable, max_threads, expected):
    assert threads_for(others, usable, max_threads) == expected


class Machine:
    """Counters that advance by a given share of others' load each second of a fake clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sample = CpuSample(busy=0, total=0, own=0, cpus=2)

    def advance(self, others: float, own: float = 1.0) -> None:
        s = self.sample
        self.now += 1.0
        self.sample = CpuSample(busy=s.busy + round(100 * (others + own)), total=s.total + 200,
                                own=s.own + round(100 * own), cpus=2)


def make_share(machine: Machine, applied: list[int]) -> ThreadShare:
    return ThreadShare(2, applied.append, usable=2, sample=lambda: machine.sample, clock=lambda: machine.now)


def test_a_neighbour_on_one_core_drops_the_step_to_one_thread_after_two_windows():
    machine, applied = Machine(), []
    share = make_share(machine, applied)
    machine.advance(others=1.0)
    share.tick()
    assert applied == [] and share.threads == 2  # one window is not enough
    machine.advance(others=1.0)
    share.tick()
    assert applied == [1] and share.threads == 1


def test_one_noisy_window_changes_nothing_and_the_neighbour_leaving_restores_the_threads():
    machine, applied = Machine(), []
    share = make_share(machine, applied)
    for others in (1.0, 0.0, 1.0, 0.0):  # alternating windows never agree twice in a row
        machine.advance(others)
        share.tick()
    assert applied == []
    for others in (1.0, 1.0, 0.1, 0.1):
        machine.advance(others)
        share.tick()
    assert applied == [1, 2] and share.threads == 2 and share.changes == 2


def test_ticks_inside_a_window_do_not_read_the_counters():
    machine, reads = Machine(), []

    def sample() -> CpuSample:
        reads.append(machine.now)
        return machine.sample

    share = ThreadShare(2, lambda n: None, usable=2, sample=sample, clock=lambda: machine.now)
    for _ in range(100):
        share.tick()  # the clock has not moved: every step between windows costs one clock read
    assert reads == [0.0]


def test_without_counters_the_configured_threads_stay():
    applied = []
    clock = iter(range(100))
    share = ThreadShare(2, applied.append, usable=2, sample=lambda: None, clock=lambda: float(next(clock)))
    for _ in range(10):
        share.tick()
    assert applied == [] and share.threads == 2


def test_torch_threads_set_on_the_engine_thread_are_that_threads_own():
    # why ThreadShare.tick runs on the loop thread: torch.set_num_threads there sizes that thread's steps and
    # leaves the caller's count alone
    before = torch.get_num_threads()
    seen = []

    def engine_thread() -> None:
        torch.set_num_threads(1)
        seen.append(torch.get_num_threads())
        torch.set_num_threads(before)  # torch also keeps the last count for threads started later: put it back

    worker = threading.Thread(target=engine_thread)
    worker.start()
    worker.join()
    assert seen == [1] and torch.get_num_threads() == before
