"""The two private hooks the connection limits stand on still have the shape they were written for.

uvicorn has no public header-read or send deadline, and asyncio no public way to end an accept
round at EMFILE, so ``serve/http/connection_guard.py`` subclasses uvicorn's internal ``H11Protocol``
and ``serve/http/accept_guard.py`` replaces the selector loop's private ``_accept_connection``. An
upgrade that changes either would not raise: the slowloris would simply stay connected, or the
loop would stall again. These tests fail first, naming the attribute and the version.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import re
import socket
import sys
from importlib.metadata import version
from typing import Any

import pytest
import tomllib

pytest.importorskip("uvicorn")

from repo_paths import ROOT

from pagedkv.serve.http.accept_guard import SHED_PER_ROUND, guard_accept  # noqa: E402
from pagedkv.serve.http.connection_guard import guarded_protocol  # noqa: E402

UVICORN = f"uvicorn {version('uvicorn')}"
PYTHON = f"Python {sys.version.split()[0]}"


def _h11_hook(what: str) -> str:
    return (f"{UVICORN}: uvicorn.protocols.http.h11_impl.H11Protocol {what}; serve/http/connection_guard.py's header "
            "and send deadlines rely on it (update the guard, then the uvicorn pin in pyproject's serve extra)")


def _loop_name() -> str:
    loop = asyncio.new_event_loop()
    try:
        return type(loop).__name__
    finally:
        loop.close()


def _accept_hook(what: str) -> str:
    return (f"{PYTHON}: asyncio's private {_loop_name()}._accept_connection {what}; serve/http/accept_guard.py's "
            "EMFILE guard relies on it")


def test_the_installed_uvicorn_is_in_the_pinned_range():
    serve = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["serve"]
    spec = next(s for s in serve if s.startswith("uvicorn"))
    low, high = re.fullmatch(r"uvicorn>=([\d.]+),<([\d.]+)", spec).groups()
    installed = tuple(int(p) for p in re.findall(r"\d+", version("uvicorn"))[:3])
    as_tuple = lambda v: tuple(int(p) for p in v.split("."))  # noqa: E731
    assert as_tuple(low) <= installed < as_tuple(high), (
        f"{UVICORN} is outside the serve extra's {spec}: run this file's shape checks against it, then widen the pin")


# --- uvicorn's H11Protocol ---------------------------------------------------------------------------------------


class _Transport(asyncio.Transport):
    """Enough of a socket transport for H11Protocol: what it writes is kept."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closing = False

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 5555), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data):
        self.written += data

    def is_closing(self):
        return self.closing

    def close(self):
        self.closing = True

    abort = close

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass

    def get_write_buffer_size(self):
        return 0


async def _app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_h11_protocol_has_the_methods_the_guard_extends():
    from uvicorn.protocols.http import h11_impl

    assert hasattr(h11_impl, "H11Protocol"), _h11_hook("is gone")
    for method in ("connection_made", "data_received", "on_response_complete", "connection_lost",
                   "pause_writing", "resume_writing"):
        assert callable(getattr(h11_impl.H11Protocol, method, None)), _h11_hook(f"has no method {method}")
    params = list(inspect.signature(h11_impl.H11Protocol).parameters)
    assert params[:3] == ["config", "server_state", "app_state"], _h11_hook(f"takes {params}")


def _connected_protocol() -> tuple[Any, _Transport]:
    """A guarded uvicorn protocol over ``_app``, connected to a fake transport (call inside a running loop)."""
    import uvicorn
    from uvicorn.server import ServerState

    protocol_class = guarded_protocol(header_timeout=30, send_timeout=30)
    config = uvicorn.Config(_app, http=protocol_class, log_level="warning", lifespan="off")
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={},
                              _loop=asyncio.get_running_loop())
    transport = _Transport()
    protocol.connection_made(transport)
    return protocol, transport


def test_a_new_cycle_marks_a_complete_head_and_on_response_complete_follows_each_response():
    """What the header deadline reads: ``cycle`` stays as it was until a request head is complete, is a new
    object then, and the cycle calls ``on_response_complete`` when its response is sent."""

    async def exchange() -> None:
        protocol, transport = _connected_protocol()
        assert hasattr(protocol, "cycle") and protocol.cycle is None, _h11_hook("has no cycle before a request")
        assert list(protocol.waiting.never_asked.values()) == [protocol], _h11_hook("was not armed at connect")
        protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n")
        assert protocol.cycle is None, _h11_hook("starts a cycle before the request head is complete")
        protocol.data_received(b"\r\n")
        cycle = protocol.cycle
        assert cycle is not None, _h11_hook("starts no cycle (self.cycle) once a request head is complete")
        assert not protocol.waiting.never_asked and protocol._deadline is None, "the header deadline stayed armed"
        for _ in range(20):  # the app's task sends its response
            await asyncio.sleep(0)
            if cycle.response_complete:
                break
        assert getattr(cycle, "response_complete", False), _h11_hook("left response_complete unset after a response")
        assert transport.written.startswith(b"HTTP/1.1 200"), transport.written
        assert list(protocol.waiting.between_requests.values()) == [protocol], _h11_hook(
            "did not call on_response_complete after the response (the guard re-arms there)")
        protocol.connection_lost(None)
        assert not protocol.waiting.between_requests and protocol._deadline is None

    asyncio.run(exchange())


def test_an_eof_after_a_complete_request_keeps_the_transport_until_the_answer_is_sent():
    """What the half-close reads: ``conn`` is the h11 connection (``their_state`` DONE once a request is complete),
    and ``eof_received``'s answer decides whether asyncio closes the transport."""
    import h11

    assert callable(getattr(__import__("uvicorn.protocols.http.h11_impl", fromlist=["H11Protocol"]).H11Protocol,
                            "eof_received", None)), _h11_hook("has no method eof_received")

    async def exchange() -> None:
        protocol, transport = _connected_protocol()
        assert not protocol.eof_received(), "an EOF before any request must close the connection"
        protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert isinstance(getattr(protocol, "conn", None), h11.Connection), _h11_hook("has no h11 conn")
        assert protocol.conn.their_state is h11.DONE, _h11_hook("did not read the whole request into conn")
        assert protocol.eof_received() is True and not transport.closing
        cycle = protocol.cycle
        for _ in range(20):
            await asyncio.sleep(0)
            if cycle.response_complete:
                break
        assert transport.written.startswith(b"HTTP/1.1 200") and transport.written.endswith(b"ok")
        assert transport.closing, "the half-closed connection stayed open after its answer"
        protocol.connection_lost(None)

    asyncio.run(exchange())


# --- asyncio's accept handler ------------------------------------------------------------------------------------


class _ExhaustedSocket:
    """A listening socket as it is when the process is out of descriptors: every accept() is EMFILE."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.accepts = 0

    def accept(self):
        self.accepts += 1
        raise OSError(errno.EMFILE, "Too many open files")

    def fileno(self) -> int:
        return self.fd


def test_the_selector_loop_has_the_accept_handler_the_guard_replaces():
    loop = asyncio.new_event_loop()
    try:
        for name in ("_accept_connection", "_add_reader", "_remove_reader"):
            assert callable(getattr(loop, name, None)), _accept_hook(f"is missing ({name})")
        params = list(inspect.signature(loop._accept_connection).parameters)
        assert params[:2] == ["protocol_factory", "sock"], _accept_hook(f"takes {params}")
        assert guard_accept(loop, lambda count: 0), _accept_hook("could not be replaced")
    finally:
        loop.close()


def test_create_server_accepts_through_the_replaced_handler():
    """asyncio looks the handler up on the loop when it starts serving, so the replacement is the one used."""
    seen = []

    async def serve_once() -> None:
        loop = asyncio.get_running_loop()
        assert guard_accept(loop, lambda count: 0)
        guarded = loop._accept_connection

        def counting(*args, **kwargs):
            seen.append(args[1])
            return guarded(*args, **kwargs)

        loop._accept_connection = counting
        connected = asyncio.Event()

        class Connected(asyncio.Protocol):
            def connection_made(self, transport):
                connected.set()
                transport.close()

        server = await loop.create_server(Connected, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.wait_for(connected.wait(), 10)
        writer.close()
        server.close()
        await server.wait_closed()

    asyncio.run(serve_once())
    assert seen, _accept_hook("is no longer what create_server's listening socket calls")


def test_an_emfile_ends_the_accept_round_quietly_and_sheds():
    """Through the real handler: the first EMFILE ends the round (one accept(), no asyncio error report),
    and the guard asks for room a moment later."""
    reported, shed = [], []
    left, right = socket.socketpair()

    async def exhaust() -> _ExhaustedSocket:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda loop, context: reported.append(context))
        assert guard_accept(loop, lambda count: shed.append(count) or 0, retry_delay=60)
        sock = _ExhaustedSocket(left.fileno())
        loop._accept_connection(asyncio.Protocol, sock, None, None, 100)
        await asyncio.sleep(0.2)
        return sock

    try:
        sock = asyncio.run(exhaust())
    finally:
        left.close()
        right.close()
    assert sock.accepts == 1, _accept_hook(f"called accept() {sock.accepts} times after an EMFILE in one round")
    assert reported == [], _accept_hook(f"reported {reported}")
    assert shed == [SHED_PER_ROUND], f"the guard did not ask to shed after the EMFILE: {shed}"
