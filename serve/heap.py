"""The server process's heap: a garbage collector that does not scan the startup heap, and freed memory
given back to the operating system.

A full (generation 2) collection walks every tracked object; with torch, transformers and the model
loaded that is ~0.4 s with the GIL held, and building one big answer (``n`` x tokens x 21 logprob
entries) allocates enough to trigger several: the event loop stalled ~0.5 s per answer even with the
answer built on a worker thread. As vLLM does after loading, :func:`freeze_startup_heap` collects
once and moves everything alive at startup to the permanent generation, so later collections walk
only what requests allocated.

glibc's malloc keeps the pages of freed blocks in its arenas (each thread's arena trims only
its own top, and only past a threshold), so a burst of large answers or request bodies freed
by the asyncio thread and the parse workers can stay in the RSS for good: +535 MiB after four
3.9 MB token-id bodies were parsed and freed. ``malloc_trim(0)`` returns every free page of
every arena. :class:`PeriodicTrim` calls it on its own thread (ctypes releases the GIL for the
call), only while the server has worked since the last trim and once more after that (memory freed
after the last step, as an answer is sent), so an idle server does nothing. Without glibc it is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import threading
from collections.abc import Callable

log = logging.getLogger("pagedkv.serve")

TRIM_INTERVAL_S = 5.0


def _libc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc (musl, macOS): nothing to call
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def freeze_startup_heap() -> None:
    """Collect once, then keep everything alive now out of later collections (``gc.freeze``)."""
    gc.collect()
    gc.freeze()


def malloc_trim() -> bool:
    """Return the free pages of every malloc arena to the OS now; False where there is no glibc."""
    trim = _libc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class PeriodicTrim:
    """Calls :func:`malloc_trim` every ``interval`` s while ``activity()`` (a step count) moves, and once after."""

    def __init__(self, activity: Callable[[], int], interval: float = TRIM_INTERVAL_S) -> None:
        self.activity = activity
        self.interval = interval
        self._trim = _libc_trim()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedkv-malloc-trim", daemon=True)

    def start(self) -> None:
        if self._trim is not None:
            self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        last, once_more = self.activity(), False
        while not self._stopped.wait(self.interval):
            now = self.activity()
            if now != last or once_more:
                try:
                    self._trim(0)
                except Exception:  # noqa: BLE001 - a failed trim only leaves memory where it was
                    log.exception("malloc_trim failed")
                once_more, last = now != last, now
