"""Ownership of a telemetry Unix socket path: ``PATH.lock`` beside it, held while the engine serves.

An existing file at the socket path is removed only when it is provably a
stale socket of ours: the lock file is not held by a live engine, it records
the device and inode of the socket a pagedkv engine created there, the file at
the path is still that very socket, and no connection of any type (stream,
datagram, seqpacket) is answered on it. Anything else (a regular file, a
live socket of any kind, another program's dead socket) is refused with a
line that says what to do; nothing that is not ours is ever deleted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat

from pagedkv.plugins.telemetry_address import TelemetryAddressError

_MARKER = "pagedkv-telemetry"
_DEAD = {errno.ECONNREFUSED, errno.EPROTOTYPE, errno.ENOENT}  # nobody bound, or a different socket type


class SocketLock:
    """The held lock on ``path + ".lock"``; :meth:`claim` to get one, :meth:`release` when done."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.lock_path = path + ".lock"
        self.fd = fd
        self.socket_id: str | None = None

    @classmethod
    def claim(cls, path: str) -> SocketLock:
        """Lock ``path`` for this engine, clearing a stale socket of ours; raise with the reason otherwise."""
        lock_path = path + ".lock"
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(lock_path, flags, 0o600)
        except OSError as exc:
            raise TelemetryAddressError(f"cannot create the telemetry lock file {lock_path}: {exc.strerror}") from None
        lock = cls(path, fd)
        try:
            lock._acquire()
            lock._clear_stale()
        except BaseException:
            os.close(fd)  # the lock file stays: it may belong to the engine that holds it
            raise
        return lock

    def _acquire(self) -> None:
        st = os.fstat(self.fd)
        if not stat.S_ISREG(st.st_mode):
            raise TelemetryAddressError(f"{self.lock_path} exists and is not a regular file; not touching it")
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = _read(self.fd).get("pid", "?")
            raise TelemetryAddressError(
                f"telemetry socket {self.path} is in use by another engine (pid {owner}, holding {self.lock_path})"
            ) from None
        with contextlib.suppress(OSError):
            if os.stat(self.lock_path).st_ino == st.st_ino:
                return
        raise TelemetryAddressError(f"telemetry socket {self.path} is being claimed by another engine; try again")

    def _clear_stale(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise TelemetryAddressError(f"telemetry socket path {self.path} exists and is not a socket; not touched")
        if _answers(self.path):
            raise TelemetryAddressError(f"telemetry socket {self.path} is in use by another program; choose another")
        recorded = _read(self.fd)
        if recorded.get("socket") != _identity(st):
            raise TelemetryAddressError(
                f"{self.path} is a socket that no pagedkv engine is known to have left (no matching "
                f"{self.lock_path}); if no program uses it, remove it yourself, or choose another path"
            )
        os.unlink(self.path)  # ours, dead, and still the same file

    def record_socket(self) -> None:
        """Write our pid and the new socket's identity into the lock file (it proves the socket is ours later)."""
        self.socket_id = _identity(os.lstat(self.path))
        text = f"{_MARKER} pid={os.getpid()} socket={self.socket_id}\n".encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, text, 0)

    def release(self, *, remove_socket: bool) -> None:
        """Remove the socket file if it is still the one we created, then the lock file, then unlock."""
        if self.fd < 0:
            return
        if remove_socket and self.socket_id is not None:
            with contextlib.suppress(OSError):
                if _identity(os.lstat(self.path)) == self.socket_id:
                    os.unlink(self.path)
        with contextlib.suppress(OSError):
            if os.stat(self.lock_path).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.lock_path)
        os.close(self.fd)
        self.fd = -1


def _identity(st: os.stat_result) -> str:
    """Device, inode and change time: an inode number alone is reused by the next file created."""
    return f"{st.st_dev}:{st.st_ino}:{st.st_ctime_ns}"


def _read(fd: int) -> dict[str, str]:
    """The ``key=value`` fields of a lock file written by :meth:`SocketLock.record_socket`."""
    try:
        text = os.pread(fd, 4096, 0).decode("ascii", "replace")
    except OSError:
        return {}
    words = text.split()
    if not words or words[0] != _MARKER:
        return {}
    return dict(w.split("=", 1) for w in words[1:] if "=" in w)


def _answers(path: str) -> bool:
    """Whether anything answers a connection of any socket type at ``path`` (unknown outcomes count as yes)."""
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_SEQPACKET):
        try:
            probe = socket.socket(socket.AF_UNIX, kind)
        except OSError:
            continue
        try:
            probe.settimeout(0.5)
            probe.connect(path)
        except OSError as exc:
            if exc.errno not in _DEAD:
                return True  # a full backlog, a timeout, a permission error: someone may be there
        else:
            return True
        finally:
            probe.close()
    return False
