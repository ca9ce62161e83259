"""Ctrl-C and SIGTERM at the command line: stop cleanly between steps, keep what finished, no traceback.

While :class:`StopBetweenSteps` is active, the first SIGINT or SIGTERM only
asks the run loop to stop after the current step (so the engine's state stays
whole, the partial summary is exact and the trace gets its ``end`` record); a
second one stops at once. Outside it, SIGTERM raises :class:`Terminated` (a
``KeyboardInterrupt``), so ``finally`` blocks and exit handlers run either way.
Once the command has returned, :class:`SignalsAfterReturn` holds signals back
while the exit handlers run, so a late one changes the exit status, not the output.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import Any


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so the same clean-up runs."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated()


def raise_on_sigterm() -> None:
    """Make SIGTERM raise :class:`Terminated` in the main thread (elsewhere signals cannot be handled)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


def exit_status(exc: BaseException | int) -> int:
    """128 + the signal number, the shell's convention: 130 for SIGINT, 143 for SIGTERM."""
    if isinstance(exc, int):
        return 128 + exc
    return 128 + (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)


def report_interrupt(exc: BaseException) -> int:
    """One line on stderr for an interrupt outside a run loop; the exit status to return."""
    name = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted (Ctrl-C)"
    print(f"engine: {name}", file=sys.stderr, flush=True)
    return exit_status(exc)


class StopBetweenSteps:
    """A context in which SIGINT/SIGTERM set :attr:`signum` instead of interrupting the current step."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopBetweenSteps:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # asked twice: stop now
            raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
        self.signum = signum
        with contextlib.suppress(OSError):  # os.write: a buffered print could re-enter a write in progress
            os.write(2, b"engine: stopping after this step (again to stop now)\n")

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old.clear()

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""


class SignalsAfterReturn:
    """For the exit after the command returned: from :meth:`hold` on, SIGINT/SIGTERM are noted, not raised.

    The command's output (or its one-line error) is complete by then; a signal raised inside an exit
    handler would print "Exception ignored in atexit callback" and a traceback, and cut short the
    handler that closes a trace or telemetry file. :attr:`status` is 128 + the last signal, or None.
    Nothing is restored: the process ends right after.
    """

    def __init__(self) -> None:
        self.status: int | None = None

    def hold(self) -> SignalsAfterReturn:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self._note)
        return self

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.status = exit_status(signum)
