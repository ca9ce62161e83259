"""The dashboard's side panels: the request table and the metrics, each drawn from a :class:`MonitorState`.

Widgets only: they read the reducer's state and never change it. The app decides when to redraw.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Sparkline, Static

from pagedkv.monitor.blockmap import GREY, LOOKS, owner_color
from pagedkv.monitor.state import CACHED, FREE, SHARED, USED, MonitorState

COLUMNS = ("", "request", "state", "prompt", "gen", "blocks", "preempt")
HEADERS = ("", "id", "state", "prompt", "gen", "blk", "pre")
STATE_STYLES = {"running": "bold #87d75f", "waiting": "#ffaf5f", "swapped": "#d787ff", "finished": GREY}


class RequestTable(DataTable):
    """One row per request the state knows, updated only for the request ids the reducer marked dirty."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._rows: set[str] = set()

    def on_mount(self) -> None:
        for name, header in zip(COLUMNS, HEADERS):  # state: as wide as its longest word from the start
            self.add_column(header, key=name or "color", width=len("finished") if name == "state" else None)

    def update_rows(self, state: MonitorState, dirty: set[str]) -> None:
        for rid in sorted(dirty, key=lambda r: (len(r), r)):
            req = state.requests.get(rid)
            if req is None:
                if rid in self._rows:
                    self.remove_row(rid)
                    self._rows.discard(rid)
                continue
            cells = (
                Text("■", style=owner_color(req.color)), rid, Text(req.state, style=STATE_STYLES.get(req.state, "")),
                str(req.prompt), str(req.generated), str(len(req.blocks) + len(req.cpu_blocks)), str(req.preemptions),
            )
            if rid in self._rows:
                for name, value in zip(COLUMNS, cells):
                    self.update_cell(rid, name or "color", value)
            else:
                self.add_row(*cells, key=rid)
                self._rows.add(rid)


class MetricsPanel(Vertical):
    """KV usage, waste and tokens/s with their sparklines, and the engine's counters."""

    def compose(self) -> ComposeResult:
        yield Static("", id="kv-label", classes="metric")
        yield Sparkline([], id="kv", summary_function=max)
        yield Static("", id="waste-label", classes="metric")
        yield Sparkline([], id="waste", summary_function=max)
        yield Static("", id="toks-label", classes="metric")
        yield Sparkline([], id="toks", summary_function=max)
        yield Static("", id="counters")

    def update_metrics(self, state: MonitorState, paused: bool) -> None:
        s = state.stats
        history = state.history
        self.query_one("#kv", Sparkline).data = list(history["kv_usage"])  # empty until data: no bar
        self.query_one("#waste", Sparkline).data = list(history["waste"])
        self.query_one("#toks", Sparkline).data = list(history["tok_s"])
        self.query_one("#kv-label", Static).update(
            f"KV usage [b]{s.get('kv_usage', 0.0):5.1f}%[/]  {s.get('used', 0)} used · {s.get('cached', 0)} cached"
            f" · {state.num_blocks} blocks"
        )
        waste = s.get("waste", 0.0)
        self.query_one("#waste-label", Static).update(f"KV waste [b]{waste:5.1f}%[/]  [dim](empty slots)[/]")
        self.query_one("#toks-label", Static).update(f"tokens/s [b]{state.tokens_per_s:7.1f}[/]")
        hit = 100.0 * float(s.get("prefix_hit_rate", 0.0))
        pause = "  [reverse] PAUSED [/]" if paused else ""
        self.query_one("#counters", Static).update(
            f"running [b]{s.get('running', 0)}[/]  waiting [b]{s.get('waiting', 0)}[/]  "
            f"swapped [b]{s.get('swapped', 0)}[/]  finished [b]{s.get('finished', 0)}[/]\n"
            f"prefix hit [b]{hit:.1f}%[/]  CoW [b]{s.get('cow', 0)}[/]  "
            f"swap out/in [b]{s.get('swap_out', 0)}/{s.get('swap_in', 0)}[/]  evicted [b]{s.get('evicted', 0)}[/]\n"
            f"preemptions [b]{s.get('preemptions', 0)}[/]  step [b]{state.step}[/]  seq {state.seq}{pause}"
        )


def legend() -> Text:
    """What each block glyph and colour means."""
    text = Text()
    for label, (glyph, color) in (
        ("free", LOOKS[FREE]), ("used (owner)", (LOOKS[USED][0], owner_color(0))),
        ("shared", LOOKS[SHARED]), ("cached", LOOKS[CACHED]),
        ("swapped", (LOOKS["swapped"][0], owner_color(1))),
    ):
        text.append(f"{glyph} ", style=f"bold {color}")
        text.append(label + "  ", style="#a8a8a8")
    text.append("██", style=f"bold {owner_color(2)}")
    text.append(" selected request", style="#a8a8a8")
    return text


def model_name(model: str) -> str:
    """A model's name for the title: the last path part, without pagedkv's conversion-cache key."""
    name = Path(model.rstrip("/")).name or model
    return re.sub(r"-[0-9a-f]{12}$", "", name)


def mapping_text(req: Any) -> Text:
    """The request's block table as ``logical→physical`` pairs, wrapping at any width and any index."""
    text = Text()
    text.append(f"request {req.id}", style=f"bold {owner_color(req.color)}")
    text.append(f" · {len(req.blocks)} blocks" + (f" + {len(req.cpu_blocks)} swapped" if req.cpu_blocks else ""),
                style="#a8a8a8")
    text.append("\nlogical→physical  ", style="#a8a8a8")
    for logical, block in enumerate(req.blocks):
        text.append(f"{logical}→{block}", style="#e4e4e4")
        text.append("  ")
    for logical, block in enumerate(req.cpu_blocks):
        text.append(f"{logical}→cpu{block}", style="#d787ff")
        text.append("  ")
    return text
