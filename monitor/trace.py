"""Replaying a recorded trace into the monitor's state (the reading itself is :mod:`pagedkv.core.trace`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedkv.core.telemetry_protocol import ProtocolError
from pagedkv.core.trace import Trace, TraceError, read_trace


def apply_message(state: Any, trace: Trace, index: int) -> None:
    """Apply message ``index`` of ``trace``; a message that contradicts the state raises :class:`TraceError`."""
    try:
        state.apply(trace.messages[index])
    except ProtocolError as exc:
        raise TraceError(f"{trace.path} line {trace.lines[index]}: {exc}") from None


def replay(path: str | Path) -> Any:
    """Apply a whole trace to a fresh :class:`MonitorState` and return it (raises :class:`TraceError`)."""
    from pagedkv.monitor.state import MonitorState

    trace = read_trace(path)
    state = MonitorState()
    for index in range(len(trace.messages)):
        apply_message(state, trace, index)
    return state
