"""OpenMP threads sleep when they wait at a barrier: the wait policy, set before torch (and its libgomp) is imported.

Why: GNU OpenMP (torch's and the cpu backend's kernels share one libgomp) spins a waiting thread ~300,000
times before sleeping, milliseconds, longer than the gap between a decode step's parallel regions, so every
thread of the pool keeps its core busy for the whole step. On a machine shared with other processes, a
thread that spins takes the core from the thread doing the step's work, and with one core taken by a
neighbour throughput fell to 0.15-0.42x of quiet (issue 43). pagedkv asks for the passive policy (a waiting
thread sleeps at once): on the shared 2-core machine it kept 0.88x (batch 1) and 1.25x (32 chats) of its
own figure when a neighbour burned a core, where libgomp's short spin for an oversubscribed pool
(GOMP_SPINCOUNT=1000) kept 0.36x / 0.67x (benchmarks/JOURNAL.md, "Shared machine"). The user's own
OMP_WAIT_POLICY or GOMP_SPINCOUNT wins. libgomp reads these once, when it loads: ``import pagedkv`` first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

WAIT_POLICY = "PASSIVE"
USER_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def wait_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables pagedkv adds to ``environ``: none where the user chose a wait policy or spin count."""
    if any(name in environ for name in USER_KNOBS):
        return {}
    return {"OMP_WAIT_POLICY": WAIT_POLICY}


ADDED: dict[str, str] = {}  # what apply() put in the process's environment


def apply(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Add :func:`wait_env` to ``environ`` (the process's by default); returns what was added."""
    added = wait_env(environ)
    environ.update(added)
    if environ is os.environ:
        ADDED.update(added)
    return added


def environ_without_ours() -> dict[str, str]:
    """The process's environment less what pagedkv added: for other programs it starts (a benchmark's peer
    servers must run with their own OpenMP defaults)."""
    return {k: v for k, v in os.environ.items() if ADDED.get(k) != v}
