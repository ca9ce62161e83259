"""A telemetry stream client: connects, reads NDJSON lines, reconnects with backoff.

Plain Python on a background thread; the monitor app passes callbacks that hop
onto its own thread. The address is checked by the same loopback rule as the
engine's, before any connection is tried.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

from pagedkv.core.telemetry_protocol import ProtocolError, decode
from pagedkv.plugins.telemetry_address import Address, parse_address


def connect(address: Address, timeout: float = 2.0) -> socket.socket:
    if address.kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target: Any = address.path
    else:
        family = socket.AF_INET6 if address.family_is_ipv6 else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        target = (address.host, address.port)  # an IP literal: no name lookup
    sock.settimeout(timeout)
    try:
        sock.connect(target)
    except OSError:
        sock.close()
        raise
    return sock


class StreamClient:
    """Read messages from ``address`` until :meth:`stop`; reconnect with exponential backoff.

    ``on_message(msg)`` gets each decoded message; ``on_status(kind, text)`` gets
    ``"connected"``, ``"disconnected"`` (with the reason and the next retry) and
    ``"error"`` (a line that is not a valid message: it is skipped and counted in ``skipped``).
    Nothing a line holds can end the reader thread: it reads until :meth:`stop`.
    """

    def __init__(
        self,
        address: str | Address,
        on_message: Callable[[dict], None],
        on_status: Callable[[str, str], None] = lambda kind, text: None,
        *,
        backoff: tuple[float, float] = (0.2, 5.0),
        reconnect: bool = True,
    ) -> None:
        self.address = parse_address(address, allow_port_zero=False) if isinstance(address, str) else address
        self.on_message, self.on_status = on_message, on_status
        self.backoff_min, self.backoff_max = backoff
        self.reconnect = reconnect
        self.connections = 0
        self.skipped = 0  # lines that were not valid messages
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, name="pagedkv-monitor-client", daemon=True)

    def start(self) -> StreamClient:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=2.0)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        delay = self.backoff_min
        while not self._stop.is_set():
            try:
                sock = connect(self.address)
            except OSError as exc:
                reason = exc.strerror or str(exc)
            else:
                delay = self.backoff_min
                self.connections += 1
                self.on_status("connected", str(self.address))
                try:
                    reason = self._read(sock)
                except Exception as exc:  # noqa: BLE001 - a bug in a callback: report it, reconnect
                    reason = f"the monitor failed on a message: {type(exc).__name__}: {exc}"
                if self._stop.is_set():
                    return
            if not self.reconnect:
                self.on_status("disconnected", f"{reason}")
                return
            self.on_status("disconnected", f"{reason}; retrying in {delay:.1f}s")
            if self._stop.wait(delay):
                return
            delay = min(self.backoff_max, delay * 2)

    def _read(self, sock: socket.socket) -> str:
        self._sock = sock
        sock.settimeout(None)
        buffer = b""
        try:
            while not self._stop.is_set():
                try:
                    chunk = sock.recv(1 << 16)
                except OSError as exc:
                    return exc.strerror or str(exc)
                if not chunk:
                    return "the engine closed the connection"
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    try:
                        msg = decode(line)
                    except ProtocolError as exc:
                        self.skipped += 1
                        self.on_status("error", f"bad line from the engine ({self.skipped} skipped so far): {exc}")
                        continue
                    self.on_message(msg)
            return "stopped"
        finally:
            self._sock = None
            sock.close()
