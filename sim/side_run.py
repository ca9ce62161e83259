"""One simulated run in a forked child, beside the parent's: independent runs use both cores.

``engine simulate`` runs the paged allocator and the static baseline on the same workload;
they share nothing, so on a machine with two or more cores the baseline runs in a child
process (forked: the workload is not copied or pickled) while the parent runs the paged
one. The child's progress and result come back through a pipe; an exception in the child
is raised again in the parent. Where ``fork`` is not available the caller runs it inline.

The child is a daemon: a parent that ends first (its own run failed, or Ctrl-C) has it
terminated with SIGTERM at exit. The fork would keep the parent's handlers (the CLI's raises
``Terminated``), so the child takes the default SIGTERM and ignores SIGINT (the parent,
in the same process group, decides what Ctrl-C means): it ends silently, never with a
traceback under the parent's one-line error.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable
from typing import Any

Progress = Callable[[int, int], None]


def can_fork() -> bool:
    return "fork" in multiprocessing.get_all_start_methods() and (os.cpu_count() or 1) >= 2


class SideRun:
    """``target(progress)`` (returning a picklable result) running in a forked child."""

    def __init__(self, target: Callable[[Progress | None], Any], report_progress: bool) -> None:
        ctx = multiprocessing.get_context("fork")
        self._recv, send = ctx.Pipe(duplex=False)
        self._progress: tuple[int, int] | None = None
        self._outcome: tuple[str, Any] | None = None
        self._process = ctx.Process(target=_child, args=(target, send, report_progress), daemon=True)
        self._process.start()
        send.close()  # (the child holds its own end)

    def poll(self, progress: Progress | None = None) -> None:
        """Take in what the child sent so far; pass its latest progress on."""
        while self._outcome is None and self._recv.poll():
            self._take(self._recv.recv(), progress)

    def result(self, progress: Progress | None = None) -> Any:
        """Wait for the child's result (its exception is raised here)."""
        while self._outcome is None:
            try:
                message = self._recv.recv()
            except EOFError:
                self._process.join()
                raise RuntimeError(f"the side run died (exit code {self._process.exitcode})") from None
            self._take(message, progress)
        self._process.join()
        kind, value = self._outcome
        if kind == "error":
            raise value
        return value

    def _take(self, message: tuple, progress: Progress | None) -> None:
        if message[0] == "progress":
            if progress is not None:
                progress(message[1], message[2])
        else:
            self._outcome = message


def _child(target: Callable[[Progress | None], Any], send: Any, report_progress: bool) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def progress(done: int, total: int) -> None:
        send.send(("progress", done, total))

    try:
        result = target(progress if report_progress else None)
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent, which raises it
        try:
            send.send(("error", exc))
        except Exception:  # noqa: BLE001 - an exception that does not pickle: its text still goes
            send.send(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))
        return
    send.send(("result", result))
