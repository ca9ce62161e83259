"""A sparkline on a fixed scale, so a bar's height means the same value all run long.

Textual's ``Sparkline`` stretches every history between its own minimum and maximum: 1% KV usage
drew full-height bars. Here the caller gives the top of the scale: 100 for a percentage, and for a
rate the highest value seen this run rounded up to 1, 2 or 5 times a power of ten, which only grows,
so older bars never jump when a new peak arrives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich.color import Color, blend_rgb
from rich.segment import Segment
from rich.style import Style
from textual.strip import Strip
from textual.widget import Widget

BARS = " ▁▂▃▄▅▆▇█"  # eighths of one row


def nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 5 times a power of ten that is >= ``value`` (1.0 for nothing yet)."""
    if value <= 0 or not math.isfinite(value):
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    for step in (1.0, 2.0, 5.0, 10.0):
        if value <= step * power * (1 + 1e-9):
            return step * power
    return 10.0 * power


def columns(data: Sequence[float], width: int) -> list[float]:
    """``data`` in ``width`` columns: the newest values on the right, each column the max of its bucket."""
    if width <= 0 or not data:
        return []
    if len(data) <= width:
        return list(data)
    size = len(data) / width
    return [max(data[int(i * size):max(int(i * size) + 1, int((i + 1) * size))]) for i in range(width)]


def levels(value: float, top: float, rows: int) -> int:
    """How many eighths of the ``rows``-high bar ``value`` fills on the scale 0..``top``.

    Any value above zero gets at least one eighth, so a little is never drawn as nothing.
    """
    if top <= 0 or value <= 0:
        return 0
    filled = min(rows * 8, round(value / top * rows * 8))
    return max(1, filled)


class ScaledSparkline(Widget):
    """Bars of ``data`` on 0..``top``, coloured from ``low`` to ``high`` by height."""

    DEFAULT_CSS = "ScaledSparkline { height: 2; }"

    def __init__(self, low: str, high: str, top: float = 100.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.low, self.high = Color.parse(low), Color.parse(high)
        self.top = top
        self.data: list[float] = []

    def set_data(self, data: Sequence[float], top: float) -> None:
        data = list(data)
        if data != self.data or top != self.top:
            self.data, self.top = data, top
            self.refresh()

    def _style(self, fraction: float) -> Style:
        rgb = blend_rgb(self.low.get_truecolor(), self.high.get_truecolor(), min(1.0, max(0.0, fraction)))
        return Style(color=Color.from_triplet(rgb))

    def render_line(self, y: int) -> Strip:
        width, rows = self.size.width, self.size.height
        bars = columns(self.data, width)
        row_from_bottom = rows - 1 - y
        segments = []
        for value in bars:
            filled = levels(value, self.top, rows) - row_from_bottom * 8
            glyph = BARS[min(8, max(0, filled))]
            segments.append(Segment(glyph, self._style(value / self.top if self.top else 0.0)))
        strip = Strip(segments, len(bars)) if segments else Strip.blank(0)
        return strip.extend_cell_length(width, self.rich_style)
