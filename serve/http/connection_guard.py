"""Connection-level defences uvicorn lacks: a header-read deadline, a send deadline, and half-closed clients.

uvicorn's h11 protocol arms its keep-alive timer (``timeout_keep_alive``, its only idle
timeout) only after a response, and cancels it on any byte received, so a connection that
sends its headers one byte at a time (a slowloris), or nothing at all, is never closed; its
``h11_max_incomplete_event_size`` bounds the header's size, not its time. The header deadline
runs whenever a connection is waiting for a request's headers (from connect, and again after
each response): when the headers are not complete in time, the connection is closed. The
body has its own deadline (``read_body``).

A client that stops reading a response (its receive window full, the socket open) makes
the transport pause writing; uvicorn's ``send`` then waits forever, and a stream's engine
requests hold their sequences and KV blocks. As nginx's ``send_timeout``, when the paused
transport sends nothing for ``send_timeout`` seconds the connection is aborted: uvicorn
sees a disconnect, the stream ends, and its requests are aborted (their blocks freed).

A client that half-closes its socket once its request is sent (``shutdown(SHUT_WR)``: curl with a
piped body, ``nc -N``, some proxies) only says it will send nothing more. uvicorn's ``eof_received``
returns None, which makes asyncio close the transport: the request saw a disconnect and the client
got 0 bytes. :class:`HalfClose` keeps the transport open for writing when the EOF follows a complete
request, answers it, then closes; an EOF anywhere else (no request yet, a body cut short) still closes.

uvicorn has no public option for any of these, so :func:`guarded_protocol` subclasses its
``H11Protocol`` (passed as ``Config(http=...)``, which takes a protocol class). The send
deadline uses only asyncio's public protocol callbacks; the header deadline reads two of
``H11Protocol``'s internals: ``cycle`` (a new object exactly when a request head is complete)
and ``on_response_complete`` (called after each response); the half-close reads ``conn`` (its h11
connection, whose public ``their_state`` is DONE once a request is complete) and overrides
``eof_received``. The ``serve`` extra pins the
uvicorn versions this was checked against; ``tests/serve/test_serve_private_hooks.py`` fails,
naming the attribute, when either changes shape.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

log = logging.getLogger("pagedkv.serve")


class WaitingConnections:
    """The connections waiting for a request head, oldest first: those that never sent one, then idle
    keep-alive ones (the order they are shed in when the process is out of descriptors)."""

    def __init__(self) -> None:
        self.never_asked: OrderedDict[int, Any] = OrderedDict()
        self.between_requests: OrderedDict[int, Any] = OrderedDict()

    def add(self, protocol: Any, asked: bool) -> None:
        (self.between_requests if asked else self.never_asked)[id(protocol)] = protocol

    def discard(self, protocol: Any) -> None:
        self.never_asked.pop(id(protocol), None)
        self.between_requests.pop(id(protocol), None)

    def shed(self, count: int) -> int:
        """Close up to ``count`` of the oldest (see accept_guard); how many were closed."""
        closed = 0
        for waiting in (self.never_asked, self.between_requests):
            while waiting and closed < count:
                _, protocol = waiting.popitem(last=False)
                protocol._disarm()
                if not protocol.transport.is_closing():
                    log.debug("closing %s: waiting for a request while out of descriptors", protocol.client)
                    protocol.transport.abort()
                    closed += 1
        return closed


class SendDeadline(asyncio.Protocol):
    """Aborts a connection whose paused transport sends nothing for ``send_timeout`` s (None: never).

    Only asyncio's public protocol surface: ``connection_made``, ``pause_writing``, ``resume_writing``,
    ``connection_lost``, and the transport's ``get_write_buffer_size`` and ``abort``.
    """

    send_timeout: float | None = None
    _send_watch: asyncio.TimerHandle | None = None
    _send_transport: Any = None

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        self._send_transport = transport
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_send_watch()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.send_timeout is not None and self._send_watch is None:
            self._watch_send(self._send_transport.get_write_buffer_size())

    def resume_writing(self) -> None:
        self._stop_send_watch()
        super().resume_writing()

    def _watch_send(self, buffered: int) -> None:
        loop = asyncio.get_running_loop()  # the callbacks run on the loop
        self._send_watch = loop.call_later(self.send_timeout, self._send_stalled, buffered)

    def _stop_send_watch(self) -> None:
        if self._send_watch is not None:
            self._send_watch.cancel()
            self._send_watch = None

    def _send_stalled(self, buffered_before: int) -> None:
        buffered = self._send_transport.get_write_buffer_size()
        if buffered < buffered_before:  # the client is reading, slowly: nginx's rule is "no progress"
            self._watch_send(buffered)
            return
        self._send_watch = None
        peer = self._send_transport.get_extra_info("peername")
        log.warning("aborting the connection from %s: it accepted no response bytes for %.3g s "
                    "(--send-timeout); its requests are aborted", _peer(peer), self.send_timeout)
        self._send_transport.abort()


class HeaderDeadline:
    """Closes a connection whose request head is not complete ``header_timeout`` s after it began waiting.

    A mixin over uvicorn's ``H11Protocol``: it reads ``cycle``, ``transport``, ``loop`` and ``client``, and
    extends ``connection_made``, ``data_received``, ``on_response_complete`` and ``connection_lost``.
    """

    header_timeout: float
    waiting: WaitingConnections
    cycle: Any  # H11Protocol's (annotations only: nothing here shadows them)
    transport: Any
    loop: asyncio.AbstractEventLoop
    client: Any
    _deadline: asyncio.TimerHandle | None = None
    _waiting_cycle: Any = None
    _asked = False  # a request head has arrived on this connection

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._deadline is not None and self.cycle is not self._waiting_cycle:
            self._asked = True
            self._disarm()  # a new request cycle: its headers are complete

    def on_response_complete(self) -> None:
        finished = self.cycle
        super().on_response_complete()  # may start a pipelined request (a new cycle)
        if self.cycle is finished and not self.transport.is_closing():
            self._arm()  # waiting for the next request's headers (idle: the keep-alive timer is shorter)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._waiting_cycle = self.cycle
        self._deadline = self.loop.call_later(self.header_timeout, self._headers_too_slow)
        self.waiting.add(self, self._asked)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self.waiting.discard(self)

    def _headers_too_slow(self) -> None:
        self._deadline = None
        self.waiting.discard(self)
        transport = self.transport
        if self.cycle is self._waiting_cycle and not transport.is_closing():
            log.debug("closing %s: no complete request head within %.3g s", self.client, self.header_timeout)
            transport.close()


class HalfClose:
    """Answers a request whose client half-closed after sending it, then closes (see the module docstring).

    A mixin over uvicorn's ``H11Protocol``: it reads ``cycle``, ``conn`` and ``transport``, overrides
    ``eof_received`` and extends ``on_response_complete``.
    """

    cycle: Any
    conn: Any
    transport: Any
    _peer_done = False  # the client sent EOF after a complete request: close once it is answered

    def eof_received(self) -> bool | None:
        import h11

        cycle = self.cycle
        if cycle is None or cycle.response_complete or self.conn.their_state is not h11.DONE:
            return None  # no request waiting for its answer: asyncio closes the transport
        self._peer_done = True
        return True  # keep the transport open for writing (asyncio stops reading it)

    def on_response_complete(self) -> None:
        finished = self.cycle
        super().on_response_complete()  # type: ignore[misc] - H11Protocol's; may start a pipelined request
        if self._peer_done and self.cycle is finished and not self.transport.is_closing():
            self.transport.close()  # flushes what is buffered first


def guarded_protocol(header_timeout: float, send_timeout: float | None = None) -> type:
    """uvicorn's H11Protocol, closing a connection whose request headers take over ``header_timeout`` s,
    aborting one that accepts no response bytes for ``send_timeout`` s (None: never), and answering a
    client that half-closed after its request.

    Its ``shed_waiting(count)`` closes the oldest connections only waiting for a request head (accept_guard
    calls it when the process is out of descriptors)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    waiting = WaitingConnections()  # per server: the class is made once per Config
    namespace = {"header_timeout": header_timeout, "send_timeout": send_timeout, "waiting": waiting,
                 "shed_waiting": staticmethod(waiting.shed), "__module__": __name__}
    return type("HeaderDeadlineProtocol", (HeaderDeadline, HalfClose, SendDeadline, H11Protocol), namespace)


def _peer(client: Any) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"
