"""The block map: one cell per physical block, drawn with Textual's Line API.

Each row's :class:`Strip` is cached and rebuilt only when a block on it changes
(the reducer reports dirty blocks), and the per-cell :class:`Segment` objects
are cached by look, so a step that touches a few blocks of a 16k-block pool
costs a few rows, not a whole repaint.
"""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from pagedkv.monitor.state import CACHED, FREE, SHARED, USED, MonitorState

CELL_WIDTH = 2
PALETTE = (
    "#5fafff", "#87d75f", "#ffaf5f", "#d787ff", "#5fd7d7", "#ff875f",
    "#afd700", "#ff5faf", "#87afff", "#d7af5f", "#5fd787", "#af87d7",
)  # owner colors, by order of first sight
LOOKS = {  # state -> (glyph, color); None: the owner's color
    FREE: ("·", "#4e4e4e"),
    USED: ("■", None),
    SHARED: ("◆", "#ffd75f"),
    CACHED: ("□", "#00afaf"),
    "swapped": ("■", None),
}
GREY = "#606060"
DIM = "#3a3a3a"  # blocks not of the selected request


def owner_color(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


class BlockMap(ScrollView, can_focus=True):
    """The GPU pool (``kind="gpu"``) or the CPU swap pool (``kind="cpu"``)."""

    DEFAULT_CSS = """
    BlockMap { height: 1fr; scrollbar-gutter: stable; scrollbar-size-vertical: 1; }
    """

    def __init__(self, kind: str = "gpu", **kwargs) -> None:
        super().__init__(**kwargs)
        self.kind = kind
        self.state: MonitorState | None = None
        self.selected: str | None = None
        self.greyed = False
        self.cols = 1
        self._count = 0
        self._rows: dict[int, Strip] = {}
        self._segments: dict[tuple, Segment] = {}
        self._blank = Segment(" " * CELL_WIDTH)
        self._logical: dict[int, int] = {}  # block -> logical index, for the selected request (highlighted)
        self.rows_built = 0  # rows rendered since start (tests check that only dirty rows are)

    # --- what a cell looks like ------------------------------------------------------------------

    @property
    def count(self) -> int:
        if self.state is None:
            return 0
        return self.state.num_blocks if self.kind == "gpu" else self.state.num_cpu_blocks

    def cell(self, block: int) -> tuple[str, str, int | None]:
        """(state, color, logical index if the block belongs to the selected request)."""
        state = self.state
        assert state is not None
        if self.kind == "gpu":
            kind = state.block_state(block)
            owner = state.owner(block)
        else:
            rid = state.cpu_holders.get(block)
            owner = state.requests.get(rid) if rid is not None else None
            kind = "swapped" if rid is not None else FREE
        glyph, color = LOOKS[kind]
        if color is None:
            color = owner_color(owner.color) if owner is not None else "#bcbcbc"
        return kind, color, self._logical.get(block)

    def _segment(self, block: int) -> Segment:
        kind, color, logical = self.cell(block)
        selecting = self.selected is not None
        key = (kind, color, logical is not None, selecting, self.greyed)
        seg = self._segments.get(key)
        if seg is None:
            glyph = LOOKS[kind][0]
            if self.greyed:
                seg = Segment(glyph + " ", Style(color=GREY, dim=True))
            elif logical is not None:  # the selected request's block: a solid cell in its color
                seg = Segment("██", Style(color=color, bold=True))
            elif selecting:  # everything else steps back, so the selection reads at a glance
                seg = Segment(glyph + " ", Style(color=DIM, dim=True))
            else:
                seg = Segment(glyph + " ", Style(color=color, bold=kind == SHARED))
            self._segments[key] = seg
        return seg

    # --- layout and drawing -----------------------------------------------------------------------

    def attach(self, state: MonitorState) -> None:
        self.state = state
        self.relayout()

    def relayout(self) -> None:
        width = self.scrollable_content_region.width or self.size.width
        self.cols = max(1, width // CELL_WIDTH)
        self._count = self.count
        rows = -(-self._count // self.cols) if self._count else 0
        self.virtual_size = Size(self.cols * CELL_WIDTH, rows)
        self._rows.clear()
        self.refresh()

    def on_resize(self) -> None:
        self.relayout()

    def update_blocks(self, everything: bool, blocks: set[int]) -> None:
        """Redraw the rows holding ``blocks`` (or everything)."""
        if everything or self.count != self._count:
            self._select_logical()
            self.relayout()
            return
        for row in {b // self.cols for b in blocks}:
            if self._rows.pop(row, None) is not None:
                self.refresh_line(row)

    def select(self, request_id: str | None) -> None:
        """Highlight the request's blocks and dim the rest (its logical -> physical map is listed beside)."""
        changed = (request_id is None) != (self.selected is None)
        self.selected = request_id
        self._select_logical()
        if changed or request_id is not None:
            self._rows.clear()  # every cell's look depends on whether something is selected
            self.refresh()

    def refresh_selection(self) -> None:
        """The selected request's table may have changed; renumber and redraw what moved."""
        if self.selected is None:
            return
        before = dict(self._logical)
        self._select_logical()
        changed = {b for b in set(before) | set(self._logical) if before.get(b) != self._logical.get(b)}
        if changed:
            self.update_blocks(False, changed)

    def _select_logical(self) -> None:
        self._logical = {}
        state = self.state
        if self.selected is None or state is None:
            return
        req = state.requests.get(self.selected)
        if req is not None:
            blocks = req.blocks if self.kind == "gpu" else req.cpu_blocks
            self._logical = {b: i for i, b in enumerate(blocks)}

    def set_greyed(self, greyed: bool) -> None:
        if greyed != self.greyed:
            self.greyed = greyed
            self._rows.clear()
            self.refresh()

    def row_strip(self, row: int) -> Strip:
        strip = self._rows.get(row)
        if strip is None:
            start = row * self.cols
            end = min(start + self.cols, self._count)
            segments = [self._segment(b) for b in range(start, end)]
            strip = Strip(segments, (end - start) * CELL_WIDTH) if segments else Strip.blank(0)
            strip = strip.apply_style(self.rich_style)  # the widget's background under every cell
            self._rows[row] = strip
            self.rows_built += 1
        return strip

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        row = scroll_y + y
        width = self.scrollable_content_region.width or self.size.width
        if self.state is None or row * self.cols >= self._count:
            return Strip.blank(width, self.rich_style)
        return self.row_strip(row).crop(scroll_x, scroll_x + width).extend_cell_length(width, self.rich_style)

    def cell_text(self, block: int) -> str:
        """The two characters drawn for ``block`` (tests read the map through this)."""
        return self._segment(block).text
