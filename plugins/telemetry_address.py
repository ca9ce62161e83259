"""Where telemetry may go: a Unix socket, or TCP on a loopback address. Nothing else.

The decision is made from the address string alone, before any socket is
created or any name is looked up: ``localhost`` is mapped to ``127.0.0.1`` by
this module, never resolved, and every other host name is refused.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from pagedkv.core.errors import ConfigError

_FORMS = "use unix:PATH or tcp:127.0.0.1:PORT (tcp:[::1]:PORT and tcp:localhost:PORT also work)"


class TelemetryAddressError(ConfigError):
    """The telemetry address is malformed or not on this machine."""


@dataclass(frozen=True)
class Address:
    kind: str  # "unix" or "tcp"
    path: str | None = None  # unix
    host: str | None = None  # tcp: an IP literal, always loopback
    port: int | None = None  # tcp

    @property
    def family_is_ipv6(self) -> bool:
        return self.kind == "tcp" and ":" in (self.host or "")

    def __str__(self) -> str:
        if self.kind == "unix":
            return f"unix:{self.path}"
        host = f"[{self.host}]" if self.family_is_ipv6 else self.host
        return f"tcp:{host}:{self.port}"


def parse_address(text: str, *, allow_port_zero: bool = True) -> Address:
    """Parse and check a telemetry address; raise :class:`TelemetryAddressError` with the reason."""
    if not isinstance(text, str) or not text.strip():
        raise TelemetryAddressError(f"empty telemetry address; {_FORMS}")
    text = text.strip()
    scheme, sep, rest = text.partition(":")
    if not sep:
        raise TelemetryAddressError(f"telemetry address {text!r} has no scheme; {_FORMS}")
    scheme = scheme.lower()
    if scheme == "unix":
        return _parse_unix(text, rest)
    if scheme == "tcp":
        return _parse_tcp(text, rest, allow_port_zero)
    raise TelemetryAddressError(f"telemetry address {text!r}: scheme {scheme!r} is not allowed; {_FORMS}")


def _parse_unix(text: str, path: str) -> Address:
    if not path:
        raise TelemetryAddressError(f"telemetry address {text!r} has an empty socket path")
    if "\0" in path:
        raise TelemetryAddressError(f"telemetry address {text!r}: the socket path contains a NUL byte")
    if path.startswith("@"):
        raise TelemetryAddressError(
            f"telemetry address {text!r}: abstract Unix sockets cannot be restricted to mode 0600; give a file path"
        )
    return Address("unix", path=path)


def _parse_tcp(text: str, rest: str, allow_port_zero: bool) -> Address:
    if rest.startswith("["):  # tcp:[::1]:PORT
        host, bracket, port_text = rest[1:].partition("]")
        if not bracket or not port_text.startswith(":"):
            raise TelemetryAddressError(f"telemetry address {text!r}: write an IPv6 host as tcp:[::1]:PORT")
        port_text = port_text[1:]
    else:
        host, sep, port_text = rest.rpartition(":")
        if not sep or not host:
            raise TelemetryAddressError(f"telemetry address {text!r} needs a host and a port; {_FORMS}")
    port = _parse_port(text, port_text, allow_port_zero)
    if host.lower() == "localhost":
        return Address("tcp", host="127.0.0.1", port=port)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise TelemetryAddressError(
            f"telemetry address {text!r}: host {host!r} is not an IP literal; only loopback addresses "
            "(127.x.x.x, ::1) or the word localhost are allowed, and names are never looked up"
        ) from None
    if not ip.is_loopback:
        raise TelemetryAddressError(
            f"telemetry address {text!r}: {host} is not a loopback address; telemetry never leaves this "
            "machine (use 127.0.0.1, ::1 or a unix: socket)"
        )
    return Address("tcp", host=str(ip), port=port)


def _parse_port(text: str, port_text: str, allow_zero: bool) -> int:
    if not port_text.isdigit():
        raise TelemetryAddressError(f"telemetry address {text!r}: port {port_text!r} is not a number")
    port = int(port_text)
    if not (0 if allow_zero else 1) <= port <= 65535:
        raise TelemetryAddressError(f"telemetry address {text!r}: port {port} is out of range")
    return port
