"""Accepting connections when the process is out of file descriptors (EMFILE), without stalling the event loop.

asyncio's accept handler (CPython 3.10-3.13) does not stop at EMFILE: it keeps calling
``accept()`` up to the listen backlog (uvicorn: 2048 times), reporting each failure and
scheduling one retry timer per failure. Every failed ``accept()`` releases the GIL, so next
to a busy engine thread each one waits for it again: 300 silent sockets under ``ulimit -n
256`` held the loop for 1-2 s per retry, and ``/health`` on an open connection with it.

:func:`guard_accept` wraps the loop's handler so that the first EMFILE ends the round. A moment later
(once the connections that round accepted are set up), as nginx reuses its idle connections
when it runs out, the oldest connections that are only waiting for a request head (``shed``:
the ones that never sent a request first, then idle keep-alive ones) are closed so that new
clients get in; with none to close, accepting pauses for ``retry_delay`` seconds. One warning
line per ``report_every`` seconds says so.

No public asyncio API changes how a listening socket's accept round ends (uvicorn's public
``backlog`` option would shorten the round, but also the kernel's listen queue), so the guard
replaces the selector loop's private ``_accept_connection`` and uses its ``_add_reader`` /
``_remove_reader``; ``tests/serve/test_serve_private_hooks.py`` fails, naming them and the Python
version, when they change shape. Where they are missing (uvloop, another loop) the guard is
not installed, and :func:`quiet_accept_errors` (a public exception handler) at least turns
asyncio's traceback per failed ``accept()`` into one warning line per ``interval`` seconds.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("pagedkv.serve")

_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
SHED_PER_ROUND = 16  # connections closed per EMFILE (nginx drains 32 at a time)
_SETTLE_S = 0.02  # after an EMFILE, before choosing what to close: new connections register in connection_made


class _OneRound:
    """The listening socket as the handler sees it: an out-of-descriptors ``accept()`` ends the round."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self.failure: OSError | None = None

    def accept(self) -> Any:
        try:
            return self._sock.accept()
        except OSError as exc:
            if exc.errno not in _OUT_OF_DESCRIPTORS:
                raise
            self.failure = exc
            raise BlockingIOError(errno.EAGAIN, "accept paused: out of file descriptors") from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def guard_accept(loop: asyncio.AbstractEventLoop, shed: Callable[[int], int], retry_delay: float = 0.5,
                 report_every: float = 10.0) -> bool:
    """Install the guard on ``loop`` (before ``create_server``); False where the loop has no such handler
    (uvloop, another loop), which is left as it is."""
    original = getattr(loop, "_accept_connection", None)
    if original is None or not hasattr(loop, "_add_reader") or not hasattr(loop, "_remove_reader"):
        return False
    last_report = [-report_every]
    counts = {"shed": 0, "paused": 0}

    def accept(protocol_factory: Any, sock: Any, *args: Any, **kwargs: Any) -> None:
        probe = _OneRound(sock)
        original(protocol_factory, probe, *args, **kwargs)
        if probe.failure is None:
            return
        loop._remove_reader(sock.fileno())
        # decide a moment later: the connections accepted in this round are not set up (registered) yet
        loop.call_later(_SETTLE_S, make_room, probe.failure, (sock, accept, protocol_factory, args, kwargs))

    def make_room(failure: OSError, resume_args: tuple) -> None:
        closed = shed(SHED_PER_ROUND)
        if closed:
            counts["shed"] += closed  # their descriptors close on the next iteration, before the next accept()
            _resume(*resume_args)
        else:
            counts["paused"] += 1
            loop.call_later(retry_delay, _resume, *resume_args)
        now = time.monotonic()
        if now - last_report[0] >= report_every:
            log.warning("out of file descriptors (%s): closed %d connections that were only waiting for a request, "
                        "paused accepting %d times (raise ulimit -n, or lower --limit-concurrency)",
                        failure.strerror, counts["shed"], counts["paused"])
            last_report[0], counts["shed"], counts["paused"] = now, 0, 0

    def _resume(sock: Any, handler: Any, protocol_factory: Any, args: tuple, kwargs: dict) -> None:
        if sock.fileno() != -1:  # the server may have closed meanwhile
            loop._add_reader(sock.fileno(), handler, protocol_factory, sock, *args, **kwargs)

    loop._accept_connection = accept  # type: ignore[attr-defined]
    return True


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, interval: float = 10.0) -> None:
    """Log 'out of file descriptors' once per ``interval`` s, without a traceback; other errors as asyncio does."""
    last = [-interval]
    suppressed = [0]

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if "out of system resource" not in str(context.get("message", "")):
            loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - last[0] < interval:
            suppressed[0] += 1
            return
        exc = context.get("exception")
        more = f" ({suppressed[0]} more since the last report)" if suppressed[0] else ""
        log.warning("cannot accept connections: %s; new connections wait until descriptors free up "
                    "(raise ulimit -n, or lower --limit-concurrency)%s", exc, more)
        last[0], suppressed[0] = now, 0

    loop.set_exception_handler(handler)
