"""The Textual dashboard: block map(s), request table, metrics, legend, keys.

Messages arrive from a source (a live stream or a recorded trace) into a plain
queue; a 10 Hz timer applies them to the :class:`MonitorState` and redraws only
what the reducer marks dirty.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from textual import events
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.widgets import DataTable, Footer, Header, Static

from pagedkv.core.telemetry_protocol import ProtocolError
from pagedkv.core.trace import Trace, TraceError
from pagedkv.monitor.blockmap import BlockMap
from pagedkv.monitor.panels import MetricsPanel, end_summary, legend, mapping_text, model_name
from pagedkv.monitor.request_table import RequestTable
from pagedkv.monitor.state import MonitorState
from pagedkv.monitor.trace import apply_message

TICK_S = 0.1
MAX_PENDING = 20_000  # live messages held while paused; beyond this they are dropped (the next keyframe heals)


class MonitorApp(App):
    CSS_PATH = "monitor.tcss"
    TITLE = "pagedkv monitor"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("p", "toggle_pause", "Pause"),
        Binding("n", "step", "Step"),
        Binding("plus,equals_sign", "speed(2.0)", "Faster", show=False),
        Binding("minus", "speed(0.5)", "Slower", show=False),
        Binding("escape", "select(None)", "Clear selection", show=False),
        Binding("down", "move_selection(1)", "Next request", priority=True),
        Binding("up", "move_selection(-1)", "Previous request", show=False, priority=True),
    ]

    def __init__(
        self,
        *,
        trace: Trace | None = None,
        connect: str | None = None,
        speed: float = 1.0,
        on_start: Callable[[], Any] | None = None,
        capture: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.on_start, self.capture = on_start, capture  # engine run --monitor: start the engine, keep its prints
        if (trace is None) == (connect is None):
            raise ValueError("give exactly one of trace= and connect=")
        self.state = MonitorState()
        self.trace, self.connect, self.speed = trace, connect, speed
        self.paused = False
        self.pending: deque[dict] = deque()  # live messages not yet applied
        self.statuses: deque[tuple[str, str]] = deque()
        self.client: Any = None
        self.connected = False
        self.banner_text = ""
        self.banner_kind = ""
        self.selected: str | None = None
        self.failed = False
        self._cursor = 0  # replay: next message
        self._clock = 0.0  # replay: trace time shown so far
        self._last_tick = time.monotonic()
        self._timer: Any = None
        self._replay_done = False
        self.terminated = False  # SIGTERM ended the dashboard
        self._run = 0  # the state's run count when last drawn: a new run clears the selection

    # --- layout -------------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        yield Static("", id="banner")
        with Horizontal(id="main"):
            with Vertical(id="maps"):
                yield Static("KV blocks", id="gpu-title", classes="title")
                yield BlockMap("gpu", id="gpu")
                yield Static("CPU swap blocks", id="cpu-title", classes="title")
                yield BlockMap("cpu", id="cpu")
                yield Static(legend(), id="legend")
            with Vertical(id="side"):
                yield Static("Requests  [dim](↑/↓ select, esc clears)[/]", classes="title")
                yield RequestTable(id="requests", cursor_type="row", zebra_stripes=True)
                yield Static("", id="mapping")
                yield MetricsPanel(id="metrics")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#gpu", BlockMap).attach(self.state)
        self.query_one("#cpu", BlockMap).attach(self.state)
        self._show_cpu(False)
        if self.trace is not None:
            self.sub_title = f"replay {self.trace.path.name} at {self._speed_text()}"
            if self.trace.error is not None:
                self.set_banner(f"{self.trace.error} — showing the {len(self.trace.messages)} messages before it",
                                "error")
        else:
            from pagedkv.monitor.client import StreamClient

            self.sub_title = f"live {self.connect}"
            self.set_banner(f"waiting for the engine at {self.connect}…", "warn")
            self.client = StreamClient(self.connect, self.pending.append,
                                       lambda kind, text: self.statuses.append((kind, text))).start()
        if self.capture is not None:
            self.begin_capture_print(self, stdout=True, stderr=True)
        if self.on_start is not None:
            self.on_start()
        self._timer = self.set_interval(TICK_S, self.tick)
        self._exit_on_sigterm()
        self.tick()

    def on_print(self, event: events.Print) -> None:
        if self.capture is not None:
            self.capture.append(event.text)

    def _exit_on_sigterm(self) -> None:
        """SIGTERM closes the dashboard at once (raised in the main thread, the app's loop would swallow it)."""

        def terminate() -> None:
            self.terminated = True
            self.exit()

        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, terminate)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            pass

    def on_unmount(self) -> None:
        if self._timer is not None:
            self._timer.stop()
        if self.client is not None:
            self.client.stop()

    # --- feeding the state ------------------------------------------------------------------------------

    def tick(self) -> None:
        try:
            self._tick()
        except NoMatches:  # the app is shutting down: its widgets are gone
            pass

    def _tick(self) -> None:
        now = time.monotonic()
        elapsed, self._last_tick = now - self._last_tick, now
        while self.statuses:
            self._on_status(*self.statuses.popleft())
        if self.failed:
            return
        if self.trace is not None:
            if not self.paused:
                self._clock += elapsed * self.speed if self.speed > 0 else float("inf")
                self._play_until(self._clock)
        elif not self.paused:
            while self.pending:
                self._apply(self.pending.popleft())
        elif len(self.pending) > MAX_PENDING:
            self.pending.clear()  # the reducer sees the gap and waits for the next keyframe
        self.refresh_views()

    def _play_until(self, clock: float) -> None:
        trace = self.trace
        assert trace is not None
        messages = trace.messages
        start = messages[0].get("t", 0.0) if messages else 0.0
        while self._cursor < len(messages) and messages[self._cursor].get("t", 0.0) - start <= clock:
            self._apply_trace_message()
        if self._cursor >= len(messages) and not self.failed and trace.error is None and not self._replay_done:
            self._replay_done = True
            if self.state.ended:
                self.set_banner(f"run finished: {self._summary()} (end of replay)", "info")
            else:
                self.set_banner(f"end of replay: {len(messages)} messages, step {self.state.step}", "info")

    def _apply_trace_message(self) -> None:
        trace = self.trace
        assert trace is not None
        try:
            apply_message(self.state, trace, self._cursor)
        except TraceError as exc:
            self.failed = True
            self.set_banner(f"{exc} — replay stopped", "error")
        self._cursor += 1

    def _apply(self, msg: dict) -> None:
        try:
            self.state.apply(msg)
        except ProtocolError as exc:
            self.set_banner(f"bad message from the engine ({exc}); waiting for the next snapshot", "error")
            self.state.synced = False

    def _on_status(self, kind: str, text: str) -> None:
        if kind == "connected":
            self.connected = True
            self.set_banner(f"connected to {text}; waiting for a snapshot…", "warn")
        elif kind == "disconnected":
            self.connected = False
            if self.state.ended:  # the engine said goodbye: nothing went wrong
                self.set_banner(f"run finished: {self._summary()} — q quits", "info")
            elif self.state.seq is None:  # never got a stream yet: the engine is not up
                self.set_banner(f"waiting for the engine at {self.connect} ({text})", "warn")
            else:
                self.set_banner(f"engine disconnected: {text} — showing the last state", "error")
        elif kind == "error":
            self.set_banner(text, "error")

    def _summary(self) -> str:
        return end_summary(self.state)

    # --- drawing ----------------------------------------------------------------------------------------

    def set_banner(self, text: str, kind: str = "info") -> None:
        self.banner_text, self.banner_kind = text, kind
        banner = self.query_one("#banner", Static)
        banner.update(text)
        banner.set_classes(f"-{kind}" if text else "")
        banner.display = bool(text)

    def _show_cpu(self, show: bool) -> None:
        for name in ("#cpu", "#cpu-title"):
            self.query_one(name).display = show

    def refresh_views(self) -> None:
        state = self.state
        everything, blocks, cpu_blocks, requests = state.take_dirty()
        stale = self.trace is None and (not self.connected or not state.synced) and state.seq is not None
        gpu, cpu = self.query_one("#gpu", BlockMap), self.query_one("#cpu", BlockMap)
        if state.runs != self._run:
            self._run = state.runs
            if self.selected is not None:  # the old run's request: the same id in the new run is another request
                self.action_select(None)
        if everything:
            self._show_cpu(state.num_cpu_blocks > 0)
            self.title = f"pagedkv monitor — {model_name(state.model)}"
        if state.ended and self.trace is None and self.banner_kind != "info":
            self.set_banner(f"run finished: {self._summary()} — q quits", "info")
        if self.trace is None and self.connected and state.synced and self.banner_kind == "warn":
            self.set_banner("")
        for grid, dirty in ((gpu, blocks), (cpu, cpu_blocks)):
            grid.set_greyed(stale)
            grid.update_blocks(everything, dirty)
            if requests:
                grid.refresh_selection()
        self.query_one("#requests", RequestTable).update_rows(state, requests)
        if requests and self.selected in requests or everything:
            self._update_mapping()
        self.query_one("#metrics", MetricsPanel).update_metrics(state, self.paused)

    def _update_mapping(self) -> None:
        req = self.state.requests.get(self.selected) if self.selected is not None else None
        self.query_one("#mapping", Static).update(mapping_text(req) if req is not None else "")

    # --- keys ----------------------------------------------------------------------------------------------

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        self._last_tick = time.monotonic()
        self.refresh_views()

    def action_step(self) -> None:
        """Paused: apply the next step (a replay's next delta or snapshot, or the next live message)."""
        self.paused = True
        if self.trace is not None:
            messages = self.trace.messages
            start = messages[0].get("t", 0.0) if messages else 0.0
            while self._cursor < len(messages) and not self.failed:
                kind = messages[self._cursor]["type"]
                self._clock = messages[self._cursor].get("t", 0.0) - start
                self._apply_trace_message()
                if kind in ("delta", "snapshot"):
                    break
        elif self.pending:
            self._apply(self.pending.popleft())
        self.refresh_views()

    def action_speed(self, factor: float) -> None:
        if self.trace is not None and self.speed > 0:
            self.speed = min(1000.0, max(0.05, self.speed * factor))
            self.sub_title = f"replay {self.trace.path.name} at {self._speed_text()}"

    def _speed_text(self) -> str:
        return "full speed" if self.speed <= 0 else f"{self.speed:g}x"

    def action_select(self, request_id: str | None) -> None:
        self.selected = request_id
        for grid in self.query(BlockMap):
            grid.select(request_id)
        self._update_mapping()

    def action_move_selection(self, delta: int) -> None:
        """↑/↓ select the previous/next request wherever the focus is (no Tab first)."""
        table = self.query_one("#requests", DataTable)
        if not table.row_count:
            return
        row = 0 if self.selected is None else min(max(table.cursor_row + delta, 0), table.row_count - 1)
        table.move_cursor(row=row)
        self.action_select(table.coordinate_to_cell_key((row, 0)).row_key.value)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        rid = event.row_key.value
        self.action_select(None if rid == self.selected else rid)


def load_replay(path: str | Path) -> Trace:
    """Read a trace for the dashboard: a bad line ends the replay there, with a banner naming it."""
    from pagedkv.core.trace import read_trace

    return read_trace(path, strict=False)
