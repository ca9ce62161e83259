"""OpenMP threads sleep when they wait at a barrier: the wait policy, set before torch (and its libgomp) is imported.

Why: GNU OpenMP (torch's and the cpu backend's kernels share one libgomp) spins a waiting thread ~300,000
times before sleeping, milliseconds, longer than the gap between a decode step's parallel regions, so every
thread of the pool keeps its core busy for the whole step. On a machine shared with other processes, a
thread that spins takes the core from the thread doing the step's work, and with one core taken by a
neighbour throughput fell to 0.15-0.42x of quiet (issue 43). pagedkv asks for the passive policy (a waiting
thread sleeps at once): on the shared 2-core machine it kept 0.88x (batch 1) and 1.25x (32 chats) of its
own figure when a neighbour burned a core, where libgomp's short spin for an oversubscribed pool
(GOMP_SPINCOUNT=1000) kept 0.36x / 0.67x (benchmarks/JOURNAL.md, "Shared machine").

But on a quiet machine sleeping waits cost every parallel region a futex wake-up: a bf16 batch-1 step on the
quiet 2-core machine took 14.6 ms passive against 8.8 ms spinning (1.66x; 2 threads, ~150 regions a step).
So the passive policy is asked for only where the machine is busy when pagedkv starts (other processes
keeping at least 35% of the CPUs this process may use busy during a 0.1 s look at import: a neighbour holding
a core of two); a dedicated machine keeps libgomp's spin, as vLLM's CPU backend does with its bound threads.
Load that comes later is ``engine serve``'s thread share's to follow (``core/thread_share.py``: fewer
threads, so no barrier waits on a descheduled one). The user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT always
wins. libgomp reads these once, when it loads: ``import pagedkv`` first.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

WAIT_POLICY = "PASSIVE"
USER_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


BUSY_SHARE = 0.35  # cores other processes keep busy / usable CPUs from which the machine counts as shared
SAMPLE_S = 0.1  # how long the machine is watched at import


def wait_env(environ: Mapping[str, str], load: float, cpus: int) -> dict[str, str]:
    """The variables pagedkv adds to ``environ`` given ``load`` (the cores other processes keep busy) and the
    ``cpus`` this process may use: none where the user chose a wait policy or spin count, or where the machine
    is quiet."""
    if any(name in environ for name in USER_KNOBS) or load < BUSY_SHARE * max(1, cpus):
        return {}
    return {"OMP_WAIT_POLICY": WAIT_POLICY}


def machine_load(sample_s: float = SAMPLE_S, sample: Callable[[], Any] | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> tuple[float, int]:
    """The cores other processes keep busy now (watched for ``sample_s``: ``/proc/stat`` less this process; the
    1-minute load average where ``/proc`` cannot be read) and the CPUs this process may run on.

    Not the load average alone: it trails by a minute, so a server started just after a benchmark (or a peer
    server) had stopped counted the machine as shared and slept at every barrier (a served Q4_1 batch-1 stream
    at 65 tok/s instead of 114, benchmarks/JOURNAL.md, issue 43)."""
    from pagedkv.core.thread_share import others_cores, read_cpu_sample, usable_cpus

    sample = sample or read_cpu_sample
    cpus = usable_cpus()
    before = sample()
    if before is not None:
        sleep(sample_s)
        after = sample()
        others = others_cores(before, after) if after is not None else None
        if others is not None:
            return others, cpus
    try:
        return os.getloadavg()[0], cpus
    except (AttributeError, OSError):
        return 0.0, cpus


ADDED: dict[str, str] = {}  # what apply() put in the process's environment


def apply(environ: MutableMapping[str, str] = os.environ, load: tuple[float, int] | None = None) -> dict[str, str]:
    """Add :func:`wait_env` to ``environ`` (the process's by default; ``load``: (others' busy cores, cpus),
    measured now by default); returns what was added."""
    added = wait_env(environ, *(load or machine_load()))
    environ.update(added)
    if environ is os.environ:
        ADDED.update(added)
    return added


def environ_without_ours() -> dict[str, str]:
    """The process's environment less what pagedkv added: for other programs it starts (a benchmark's peer
    servers must run with their own OpenMP defaults)."""
    return {k: v for k, v in os.environ.items() if ADDED.get(k) != v}


OMP_PAUSE_HARD = 2  # omp_pause_resource_t (OpenMP 5.0)


def release_thread_pool() -> bool:
    """End the OpenMP worker threads the calling thread started (OpenMP 5.0's ``omp_pause_resource_all``);
    True where libgomp is loaded and did it. Call it on the thread that loaded the model before another thread
    takes over the steps (``engine serve``'s loop thread).

    Why: libgomp keeps one pool of workers per thread that opened a parallel region. A model loaded on the main
    thread and stepped on a loop thread leaves two pools, more libgomp threads than CPUs, and libgomp then cuts
    every waiting worker's spin to 1,000 turns: the workers sleep between the ~150 parallel regions of a decode
    step and each region pays a futex wake-up. A served bf16 batch-1 step took 10.7 ms against 7.0 ms offline on
    the 2-core machine; 7.0-7.5 ms once the loading thread's pool is released (benchmarks/JOURNAL.md, issue 43).
    """
    gomp = _loaded_libgomp()
    if gomp is None:
        return False
    try:
        pause = gomp.omp_pause_resource_all
    except AttributeError:  # a libgomp older than OpenMP 5.0 support (GCC < 9)
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(OMP_PAUSE_HARD) == 0


def _loaded_libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's own copy in a pip install), or None (not Linux, not loaded)."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]), None)
    except OSError:
        return None
    if path is None:
        return None
    try:
        return ctypes.CDLL(path)  # already loaded: dlopen returns the same library
    except OSError:
        return None
