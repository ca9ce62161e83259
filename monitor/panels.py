"""The dashboard's metrics panel, legend and request mapping, each drawn from a :class:`MonitorState`.

Widgets only: they read the reducer's state and never change it. The app decides when to redraw.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from pagedkv.monitor.blockmap import LOOKS, owner_color
from pagedkv.monitor.sparkline import ScaledSparkline, nice_ceiling
from pagedkv.monitor.state import CACHED, FREE, SHARED, USED, MonitorState


class MetricsPanel(Vertical):
    """KV usage, waste and tokens/s with their sparklines, and the engine's counters."""

    def compose(self) -> ComposeResult:
        yield Static("", id="kv-label", classes="metric")
        yield ScaledSparkline("#5fafff", "#ff5f5f", id="kv")
        yield Static("", id="waste-label", classes="metric")
        yield ScaledSparkline("#5f875f", "#ffaf5f", id="waste")
        yield Static("", id="toks-label", classes="metric")
        yield ScaledSparkline("#005f5f", "#87ff87", id="toks")
        yield Static("", id="counters")

    def update_metrics(self, state: MonitorState, paused: bool) -> None:
        s = state.stats
        history = state.history
        toks_top = nice_ceiling(state.peak_tok_s)
        self.query_one("#kv", ScaledSparkline).set_data(history["kv_usage"], 100.0)
        self.query_one("#waste", ScaledSparkline).set_data(history["waste"], 100.0)
        self.query_one("#toks", ScaledSparkline).set_data(history["tok_s"], toks_top)
        self.query_one("#kv-label", Static).update(
            f"KV usage [b]{s.get('kv_usage', 0.0):5.1f}%[/]  {s.get('used', 0)} used · {s.get('cached', 0)} cached"
            f" of {state.num_blocks}"
        )
        waste = s.get("waste", 0.0)
        self.query_one("#waste-label", Static).update(f"KV waste [b]{waste:5.1f}%[/]  [dim](empty slots)[/]")
        self.query_one("#toks-label", Static).update(
            f"tokens/s [b]{state.tokens_per_s:7.1f}[/]  [dim](scale 0-{toks_top:g})[/]")
        counters = self.query_one("#counters", Static)
        counters.update(status_text(state, paused, counters.content_region.width or 200))


def status_text(state: MonitorState, paused: bool, width: int = 200) -> Text:
    """The counters under the sparklines: three groups of ``label value`` items, laid out for ``width``.

    A group that does not fit breaks between items, never inside one, and its continuation lines
    start with two spaces, so even a copy of the screen with its lines joined keeps every label apart
    from the value before it.
    """
    s = state.stats
    hit = 100.0 * float(s.get("prefix_hit_rate", 0.0))
    groups = [
        [("running", s.get("running", 0)), ("waiting", s.get("waiting", 0)), ("swapped", s.get("swapped", 0)),
         ("finished", s.get("finished", 0))],
        [("prefix hit", f"{hit:.1f}%"), ("CoW", s.get("cow", 0)),
         ("swap out/in", f"{s.get('swap_out', 0)}/{s.get('swap_in', 0)}"), ("evicted", s.get("evicted", 0))],
        [("preemptions", s.get("preemptions", 0)), ("step", state.step), ("seq", state.seq)],
    ]
    text = Text(no_wrap=True, overflow="crop")
    used = 0
    for g, group in enumerate(groups):
        if g:
            text.append("\n")
        used = 0
        for i, (label, value) in enumerate(group):
            item = len(label) + 1 + len(str(value))
            if i and used + 2 + item > width:
                text.append("\n")
                used = 0
            if i:
                text.append("  ")
                used += 2
            text.append(f"{label} ")
            text.append(str(value), style="bold")
            used += item
    if paused:
        text.append("\n  " if used + 10 > width else "  ")
        text.append(" PAUSED ", style="reverse")
    return text


def end_summary(state: MonitorState) -> str:
    """The end banner's counts: requests, not samples (an n=3 request is one request of three samples)."""
    s = state.stats
    count = state.finished_requests
    requests = f"{'at least ' if state.joined_late else ''}{count} request{'' if count == 1 else 's'} finished"
    samples = s.get("finished", count)
    if samples != count:
        requests += f" ({samples} samples)"
    return (f"{requests}, {s.get('generated', 0)} tokens generated, "
            f"{s.get('preemptions', 0)} preemptions, step {state.step}")


def legend() -> Text:
    """What each block glyph and colour means. Used (GPU grid) and swapped (CPU grid) blocks share one entry:
    both are drawn in their owner's colour, so a request reads the same in either grid."""
    owner = owner_color(0)
    text = Text()
    for label, (glyph, color) in (
        ("free", LOOKS[FREE]), ("used/swapped (owner)", (LOOKS[USED][0], owner)), ("shared", LOOKS[SHARED]),
        ("cached", LOOKS[CACHED]), ("selected", ("██", owner)),
    ):
        text.append(f"{glyph} ", style=f"bold {color}")
        text.append(label + "  ", style="#a8a8a8")
    text.rstrip()
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
