"""How long OpenMP threads spin at a barrier before they sleep, set before torch (and its libgomp) is imported.

Why: GNU OpenMP (torch's and the cpu backend's kernels share one libgomp) spins a waiting thread ~300,000
times before sleeping, milliseconds, longer than the gap between a decode step's parallel regions, so every
thread of the pool keeps its core busy for the whole step. On a machine shared with other processes, a
thread that spins takes the core from the thread doing the step's work, and with one core taken by a
neighbour throughput fell to 0.15-0.42x of quiet (issue 43). libgomp itself spins only 1,000 times when
it sees more threads than CPUs, which it cannot see when the other threads are another process's; pagedkv
asks for that short spin always: a wait a few microseconds long still spins, a longer one sleeps.
vLLM's CPU backend does the same for Intel's OpenMP (a 1 ms block time). The user's own OMP_WAIT_POLICY or
GOMP_SPINCOUNT wins. libgomp reads these once, when it loads: ``import pagedkv`` before torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

SPIN_COUNT = "1000"  # libgomp's own spin count for an oversubscribed pool
USER_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def wait_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables pagedkv adds to ``environ``: none where the user chose a wait policy or spin count."""
    if any(name in environ for name in USER_KNOBS):
        return {}
    return {"GOMP_SPINCOUNT": SPIN_COUNT}


def apply(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Add :func:`wait_env` to ``environ`` (the process's by default); returns what was added."""
    added = wait_env(environ)
    environ.update(added)
    return added
