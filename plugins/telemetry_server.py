"""The telemetry socket server: a background thread that fans lines out to clients.

The engine thread only appends to per-client queues (under a short lock) and
pokes the thread awake; it never touches a socket. Each queue is bounded: when
a client falls behind, its queue is emptied and refilled with the resync
payload (newest keyframe plus the deltas since), so the client heals instead of
the engine waiting. A client that hangs up or errors is forgotten.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

from pagedkv.plugins.socket_lock import SocketLock
from pagedkv.plugins.telemetry_address import Address, TelemetryAddressError

log = logging.getLogger("pagedkv.telemetry")
_ACCEPT_BACKOFF_MIN_S = 0.05
_ACCEPT_BACKOFF_MAX_S = 1.0


class RateLimitedLog:
    """At most one warning per ``period_s`` per kind; the next one says how many were held back."""

    def __init__(self, logger: logging.Logger, period_s: float) -> None:
        self.logger, self.period_s = logger, period_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warn(self, kind: str, fmt: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -float("inf")) < self.period_s:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        held = self._held.pop(kind, 0)
        self._last[kind] = now
        suffix = f" ({held} more like it in the last {self.period_s:g}s)" if held else ""
        self.logger.warning(fmt + suffix, *args)


class _Client:
    __slots__ = ("sock", "name", "queue", "queued_bytes", "out", "drops", "alive")

    def __init__(self, sock: socket.socket, name: str) -> None:
        self.sock = sock
        self.name = name
        self.queue: deque[bytes] = deque()
        self.queued_bytes = 0
        self.out = memoryview(b"")  # the line being written; never cut in the middle
        self.drops = 0
        self.alive = True


class TelemetryServer:
    """Listen on ``address``; ``greeting()`` gives the lines a new client starts with.

    ``resync()`` gives the lines that rebuild a client's state (used after an
    overflow); ``heartbeat()`` gives an idle line. All three are called with the
    server's lock held, so they see a consistent state.
    """

    def __init__(
        self,
        address: Address,
        greeting: Callable[[], list[bytes]],
        resync: Callable[[], list[bytes]],
        heartbeat: Callable[[], bytes],
        *,
        max_lines: int = 1024,
        max_bytes: int = 32 << 20,
        heartbeat_s: float = 1.0,
        sndbuf: int | None = None,
        max_clients: int = 16,
        warn_period_s: float = 10.0,
    ) -> None:
        self.address = address
        self._greeting, self._resync, self._heartbeat = greeting, resync, heartbeat
        self.max_lines, self.max_bytes, self.heartbeat_s = max_lines, max_bytes, heartbeat_s
        self.sndbuf = sndbuf  # the kernel's send buffer per client (tests shrink it to show a slow client)
        self.max_clients = max_clients
        self.lock_file: SocketLock | None = None
        self.total_refused = 0
        self.accept_failures = 0
        self._accept_backoff = 0.0
        self._accept_paused_until = 0.0
        self._warnings = RateLimitedLog(log, warn_period_s)
        self.lock = threading.Lock()
        self.clients: list[_Client] = []
        self.total_drops = 0
        self.total_clients = 0
        self._listener = self._listen(address)
        self.bound = self._bound_address()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="pagedkv-telemetry", daemon=True)
        self._thread.start()

    # --- setup -----------------------------------------------------------------------------------

    def _listen(self, address: Address) -> socket.socket:
        if address.kind == "unix":
            return self._listen_unix(address.path or "")
        family = socket.AF_INET6 if address.family_is_ipv6 else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address.host, address.port))  # an IP literal: no name lookup happens
        except OSError as exc:
            sock.close()
            raise TelemetryAddressError(f"cannot listen on telemetry address {address}: {exc.strerror}") from None
        sock.listen(8)
        sock.setblocking(False)
        return sock

    def _listen_unix(self, path: str) -> socket.socket:
        self.lock_file = SocketLock.claim(path)  # refuses unless the path is free or provably our stale socket
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket file is created 0600, with no window where it is wider
        try:
            sock.bind(path)
        except OSError as exc:
            sock.close()
            self.lock_file.release(remove_socket=False)
            raise TelemetryAddressError(f"cannot create telemetry socket {path}: {exc.strerror}") from None
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        self.lock_file.record_socket()
        sock.listen(8)
        sock.setblocking(False)
        return sock

    def _bound_address(self) -> str:
        if self.address.kind == "unix":
            return str(self.address)
        host, port = self._listener.getsockname()[:2]
        return str(Address("tcp", host=host, port=port))

    # --- called from the engine thread -----------------------------------------------------------

    def broadcast(self, lines: list[bytes]) -> None:
        """Queue ``lines`` for every client; the caller holds ``self.lock``."""
        for client in self.clients:
            for line in lines:
                self._put(client, line)
        self._wake()

    def _put(self, client: _Client, line: bytes) -> None:
        if len(client.queue) >= self.max_lines or client.queued_bytes + len(line) > self.max_bytes:
            client.queue.clear()
            client.queued_bytes = 0
            client.drops += 1
            self.total_drops += 1
            for resync_line in self._resync():  # already includes ``line``'s state
                client.queue.append(resync_line)
                client.queued_bytes += len(resync_line)
            return
        client.queue.append(line)
        client.queued_bytes += len(line)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"x")

    def close(self) -> None:
        """Flush what is queued (briefly), then stop and remove the socket file."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            with self.lock:
                pending = any(c.queue or c.out for c in self.clients)
            if not pending:
                break
            self._wake()
            time.sleep(0.01)
        self._stopping = True
        self._wake()
        self._thread.join(timeout=2.0)
        for client in self.clients:
            with contextlib.suppress(OSError):
                client.sock.close()
        self.clients = []
        with contextlib.suppress(OSError):
            self._listener.close()
        if self.lock_file is not None:
            self.lock_file.release(remove_socket=True)  # only the socket file we created, then the lock
        self._wake_r.close()
        self._wake_w.close()

    # --- the server thread -----------------------------------------------------------------------

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, "listen")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        registered: dict[_Client, int] = {}
        last_beat = time.monotonic()
        listening = True
        try:
            while not self._stopping:
                now = time.monotonic()
                if listening != (now >= self._accept_paused_until):  # accept failing: stop polling it for a while
                    listening = not listening
                    (sel.register(self._listener, selectors.EVENT_READ, "listen") if listening
                     else sel.unregister(self._listener))
                timeout = self.heartbeat_s / 2 if listening else self._accept_paused_until - now
                for key, mask in sel.select(timeout=max(0.0, min(self.heartbeat_s / 2, timeout))):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        with contextlib.suppress(BlockingIOError, OSError):
                            self._wake_r.recv(4096)
                    elif mask & selectors.EVENT_READ:
                        self._read(key.data)
                if time.monotonic() - last_beat >= self.heartbeat_s:
                    last_beat = time.monotonic()
                    with self.lock:
                        beat = self._heartbeat()
                        for client in self.clients:
                            self._put(client, beat)
                for client in list(self.clients):
                    if client.alive:
                        self._write(client)
                self._forget_dead(sel, registered)
                for client in self.clients:  # watch for writability only while something is pending
                    want = selectors.EVENT_READ | (selectors.EVENT_WRITE if client.out or client.queue else 0)
                    if registered.get(client) != want:
                        if client in registered:
                            sel.modify(client.sock, want, client)
                        else:
                            sel.register(client.sock, want, client)
                        registered[client] = want
        except Exception:  # noqa: BLE001 - telemetry must never take the engine down
            log.exception("telemetry server stopped after an error")
        finally:
            sel.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. too many open files: back off instead of spinning on a ready listener
                self.accept_failures += 1
                self._accept_backoff = min(_ACCEPT_BACKOFF_MAX_S, max(_ACCEPT_BACKOFF_MIN_S, self._accept_backoff * 2))
                self._accept_paused_until = time.monotonic() + self._accept_backoff
                self._warnings.warn("accept", "telemetry accept failed: %s; pausing new connections for up to %.1fs",
                                    exc, _ACCEPT_BACKOFF_MAX_S)
                return
            self._accept_backoff = 0.0
            if len(self.clients) >= self.max_clients:
                self.total_refused += 1
                self._warnings.warn("refused", "telemetry: refused a client: already %d clients (the max_clients "
                                    "telemetry option)", self.max_clients)
                with contextlib.suppress(OSError):
                    sock.close()
                continue
            sock.setblocking(False)
            if self.sndbuf:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.sndbuf)
            client = _Client(sock, str(peer) or "unix")
            with self.lock:
                for line in self._greeting():
                    client.queue.append(line)
                    client.queued_bytes += len(line)
                self.clients.append(client)
                self.total_clients += 1

    def _read(self, client: _Client) -> None:
        try:
            data = client.sock.recv(4096)  # clients say nothing; this only notices a hang-up
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            client.alive = False

    def _write(self, client: _Client) -> None:
        while True:
            if not client.out:
                with self.lock:
                    if not client.queue:
                        return
                    line = client.queue.popleft()
                    client.queued_bytes -= len(line)
                client.out = memoryview(line)
            try:
                sent = client.sock.send(client.out)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                client.alive = False
                return
            client.out = client.out[sent:]

    def _forget_dead(self, sel: selectors.BaseSelector, registered: dict) -> None:
        dead = [c for c in self.clients if not c.alive]
        if not dead:
            return
        with self.lock:
            self.clients = [c for c in self.clients if c.alive]
        for client in dead:
            if client in registered:
                with contextlib.suppress(KeyError, ValueError):
                    sel.unregister(client.sock)
                del registered[client]
            with contextlib.suppress(OSError):
                client.sock.close()
