"""Start-up, phase by phase: one debug line per phase (``engine --log-level debug``) with its time.

Start-up is what a user waits for before the first token (``engine run``) or the first answer
(``engine serve``); it is the sum of a few big phases (imports, loading the weights, building the
KV cache and the runner, the first step). Each is timed where it happens with :func:`phase`, so a
regression shows as one line growing, and ``benchmarks/e2e/startup.py`` reads the same lines.

A line reads ``pagedkv.startup: DEBUG: <name> 1.23 s (at 4.56 s)``: the phase's wall time and the
time since the process started (``/proc/self/stat`` on Linux, so the interpreter's and the imports'
time count; elsewhere, since this module was imported).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("pagedkv.startup")
_IMPORTED = time.perf_counter()


def _process_age() -> float | None:
    """Seconds since this process started, from the kernel's bookkeeping (None off Linux)."""
    try:
        with open(f"/proc/{os.getpid()}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


_AGE_AT_IMPORT = _process_age()


def since_start() -> float:
    """Seconds since the process started (since this module's import where the kernel cannot say)."""
    return (_AGE_AT_IMPORT or 0.0) + time.perf_counter() - _IMPORTED


def mark(name: str, seconds: float | None = None) -> None:
    """Log one phase line: ``name``, its duration if known, and the time since start."""
    if log.isEnabledFor(logging.DEBUG):
        took = f" {seconds:.2f} s" if seconds is not None else ""
        log.debug("%s%s (at %.2f s)", name, took, since_start())


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the block as the start-up phase ``name`` (a debug line when it ends, also when it raises)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        mark(name, time.perf_counter() - started)
