"""Connection-level defences uvicorn lacks: a header-read deadline, a send deadline, and one quiet line when
accept() runs dry.

uvicorn's h11 protocol arms its keep-alive timer only after a response, and cancels it
on any byte received, so a connection that sends its headers one byte at a time (a
slowloris), or nothing at all, is never closed. :func:`guarded_protocol` subclasses it
with a deadline that runs whenever the connection is waiting for a request's headers
(from connect, and again after each response): when the headers are not complete in
time, the connection is closed. The body has its own deadline (``read_body``).

A client that stops reading a response (its receive window full, the socket open) makes
the transport pause writing; uvicorn's ``send`` then waits forever, and a stream's engine
requests hold their sequences and KV blocks. As nginx's ``send_timeout``, when the paused
transport sends nothing for ``send_timeout`` seconds the connection is aborted: uvicorn
sees a disconnect, the stream ends, and its requests are aborted (their blocks freed).

When the process is out of file descriptors, asyncio logs "socket.accept() out of system
resource" with a traceback on every retry; :func:`quiet_accept_errors` turns that into
one warning line per ``interval`` seconds and leaves every other loop error to asyncio
(a fallback: ``accept_guard`` handles EMFILE itself on the loops it can wrap).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any

log = logging.getLogger("pagedkv.serve")


def guarded_protocol(header_timeout: float, send_timeout: float | None = None) -> type:
    """uvicorn's H11Protocol, closing a connection whose request headers take over ``header_timeout`` s,
    and aborting one that accepts no response bytes for ``send_timeout`` s (None: never)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    # connections waiting for a request head, oldest first: those that never sent one, then idle keep-alive ones
    never_asked: OrderedDict[int, Any] = OrderedDict()
    between_requests: OrderedDict[int, Any] = OrderedDict()

    class HeaderDeadlineProtocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _waiting_cycle: Any = None
        _send_watch: asyncio.TimerHandle | None = None
        _asked = False  # a request head has arrived on this connection

        @staticmethod
        def shed_waiting(count: int) -> int:
            """Close up to ``count`` of the oldest connections only waiting for a request head (out of
            descriptors: see accept_guard); how many were closed."""
            closed = 0
            for waiting in (never_asked, between_requests):
                while waiting and closed < count:
                    _, protocol = waiting.popitem(last=False)
                    protocol._disarm()
                    if not protocol.transport.is_closing():
                        log.debug("closing %s: waiting for a request while out of descriptors", protocol.client)
                        protocol.transport.abort()
                        closed += 1
            return closed

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._disarm_if_headers_done()

        def on_response_complete(self) -> None:
            finished = self.cycle
            super().on_response_complete()  # may start a pipelined request already (a new cycle)
            if self.cycle is finished and not self.transport.is_closing():
                self._arm()  # waiting for the next request's headers (idle: the keep-alive timer is shorter)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._stop_send_watch()
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            super().pause_writing()
            if send_timeout is not None and self._send_watch is None:
                self._watch_send(self.transport.get_write_buffer_size())

        def resume_writing(self) -> None:
            self._stop_send_watch()
            super().resume_writing()

        def _watch_send(self, buffered: int) -> None:
            self._send_watch = self.loop.call_later(send_timeout, self._send_stalled, buffered)

        def _stop_send_watch(self) -> None:
            if self._send_watch is not None:
                self._send_watch.cancel()
                self._send_watch = None

        def _send_stalled(self, buffered_before: int) -> None:
            buffered = self.transport.get_write_buffer_size()
            if buffered < buffered_before:  # the client is reading, slowly: nginx's rule is "no progress"
                self._watch_send(buffered)
                return
            self._send_watch = None
            log.warning("aborting the connection from %s: it accepted no response bytes for %.3g s "
                        "(--send-timeout); its requests are aborted", _peer(self.client), send_timeout)
            self.transport.abort()

        def _arm(self) -> None:
            self._disarm()
            self._waiting_cycle = self.cycle
            self._deadline = self.loop.call_later(header_timeout, self._headers_too_slow)
            (between_requests if self._asked else never_asked)[id(self)] = self

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            never_asked.pop(id(self), None)
            between_requests.pop(id(self), None)

        def _disarm_if_headers_done(self) -> None:
            if self._deadline is not None and self.cycle is not self._waiting_cycle:
                self._asked = True
                self._disarm()  # a new request cycle: its headers are complete

        def _headers_too_slow(self) -> None:
            self._deadline = None
            never_asked.pop(id(self), None)
            between_requests.pop(id(self), None)
            if self.cycle is self._waiting_cycle and not self.transport.is_closing():
                log.debug("closing %s: no complete request head within %.3g s", self.client, header_timeout)
                self.transport.close()

    return HeaderDeadlineProtocol


def _peer(client: Any) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


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
