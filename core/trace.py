"""Reading a recorded telemetry trace (``engine run --trace FILE``): every line checked, errors name the line.

Shared by the simulator (workloads and step-time calibration from a trace) and the monitor (replay),
so it sits in core beside the wire format it reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.core.limits import check_cap
from pagedkv.core.telemetry_protocol import ProtocolError, decode


class TraceError(ValueError):
    """A trace file cannot be read or replayed; the message names the file and line."""


@dataclass
class Trace:
    path: Path
    messages: list[dict[str, Any]] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)  # the file line of each message
    error: TraceError | None = None  # set when the file goes bad after ``messages``


def read_trace(path: str | Path, *, strict: bool = True) -> Trace:
    """The trace's messages in order.

    With ``strict``, the first bad line raises :class:`TraceError`; otherwise the
    messages before it come back with the error, so a viewer can still show what
    was recorded before a crash cut the file short.
    """
    path = Path(path)
    try:
        check_cap("trace_bytes", path.stat().st_size, f"{path}: the trace's size", TraceError)
        data = path.read_bytes()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc.strerror or exc}") from None
    trace = Trace(path)
    lines = data.split(b"\n")
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            msg = decode(line)
        except ProtocolError as exc:
            cut = " (the file ends in the middle of this line: truncated?)" if lineno == len(lines) else ""
            trace.error = TraceError(f"{path} line {lineno}: {exc}{cut}")
            break
        if not trace.messages and msg["type"] != "hello":
            trace.error = TraceError(f"{path} line {lineno}: a trace starts with a hello message, not {msg['type']!r}")
            break
        trace.messages.append(msg)
        trace.lines.append(lineno)
    if trace.error is None and not trace.messages:
        trace.error = TraceError(f"{path}: the trace is empty")
    if trace.error is not None and strict:
        raise trace.error
    return trace
