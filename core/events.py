"""Telemetry events: every block and request state change, batched per step.

Recording is a list append, and only when someone listens, so the hot path
pays nothing when telemetry is off.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Event:
    kind: str  # block_alloc, block_free, block_share, block_keep, request_add, request_preempt, ...
    data: dict[str, Any] = field(default_factory=dict)


class EventLog:
    """Collects the events of the current step until the engine flushes them."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self._events: list[Event] = []

    def emit(self, kind: str, **data: Any) -> None:
        if self.enabled:
            self._events.append(Event(kind, data))

    def drain(self) -> list[Event]:
        events, self._events = self._events, []
        return events
