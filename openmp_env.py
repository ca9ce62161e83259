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
So the passive policy is asked for only where the machine is already busy when pagedkv starts (the 1-minute
load average at least half the CPUs this process may use: a neighbour holding a core of two); a dedicated
machine keeps libgomp's spin, as vLLM's CPU backend does with its bound threads. The user's own
OMP_WAIT_POLICY or GOMP_SPINCOUNT always wins (``OMP_WAIT_POLICY=PASSIVE`` on a machine that becomes shared
later). libgomp reads these once, when it loads: ``import pagedkv`` first.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping, MutableMapping

WAIT_POLICY = "PASSIVE"
USER_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


BUSY_SHARE = 0.5  # load average / usable CPUs from which the machine counts as shared


def wait_env(environ: Mapping[str, str], load: float, cpus: int) -> dict[str, str]:
    """The variables pagedkv adds to ``environ`` given the machine's 1-minute ``load`` and the ``cpus`` this
    process may use: none where the user chose a wait policy or spin count, or where the machine is quiet."""
    if any(name in environ for name in USER_KNOBS) or load < BUSY_SHARE * max(1, cpus):
        return {}
    return {"OMP_WAIT_POLICY": WAIT_POLICY}


def machine_load() -> tuple[float, int]:
    """The 1-minute load average and the CPUs this process may run on (0 load where the OS has no load average)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return load, cpus


ADDED: dict[str, str] = {}  # what apply() put in the process's environment


def apply(environ: MutableMapping[str, str] = os.environ, load: tuple[float, int] | None = None) -> dict[str, str]:
    """Add :func:`wait_env` to ``environ`` (the process's by default; ``load``: (load average, cpus), measured
    now by default); returns what was added."""
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
