"""The request table: running requests first, then waiting and swapped ones, then the newest finished.

Server ids (``cmpl-<32 hex>-0``) are longer than the side panel allows, so the id column takes
what the other columns leave and long ids are shortened in the middle, keeping the start and the
distinguishing tail; every column stays on screen at any width.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widgets import DataTable

from pagedkv.monitor.blockmap import GREY, owner_color
from pagedkv.monitor.state import MonitorState, RequestInfo

STATE_STYLES = {"running": "bold #87d75f", "waiting": "#ffaf5f", "swapped": "#d787ff", "finished": GREY}
STATE_RANK = {"running": 0, "waiting": 1, "swapped": 1, "finished": 2}
# (key, header, width): cells have no padding, so each width includes one space of gap
COLUMNS = (("color", "", 2), ("state", "state", 9), ("prompt", "prompt", 7), ("gen", "gen", 6),
           ("blocks", "blk", 5), ("preempt", "pre", 4))
MIN_ID_WIDTH = 6


def short_id(rid: str, width: int) -> str:
    """``rid`` in at most ``width`` characters: cut in the middle with an ellipsis when it is longer."""
    if len(rid) <= width:
        return rid
    if width <= 1:
        return rid[:width]
    head = (width - 1) // 2
    return rid[:head] + "…" + rid[len(rid) - (width - 1 - head):]


def row_order(state: MonitorState) -> list[str]:
    """The table's rows, top to bottom: running, then waiting/swapped (each in order of arrival), then finished
    requests newest first."""

    def key(req: RequestInfo) -> tuple[int, int]:
        rank = STATE_RANK.get(req.state, 1)
        return rank, -req.finished_order if rank == 2 else req.color

    return [r.id for r in sorted(state.requests.values(), key=key)]


class RequestId:
    """An id cell: drawn shortened to the column, sorted by the full id (the table sorts rows by it)."""

    def __init__(self, rid: str, width: int) -> None:
        self.rid, self.width = rid, width

    def __rich__(self) -> Text:
        return Text(short_id(self.rid, self.width))


class RequestTable(DataTable):
    """One row per request the state knows; cells are updated in place and rows re-sorted when the order changes
    (a sort, not a rebuild: a busy run changes the order nearly every tick)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cell_padding=0, **kwargs)
        self._order: list[str] = []
        self._rows: set[str] = set()
        self._state: MonitorState | None = None
        self.id_width = MIN_ID_WIDTH

    def on_mount(self) -> None:
        self._add_columns()

    def _add_columns(self) -> None:
        self.add_column("", key="color", width=2)
        self.add_column("id", key="request", width=self.id_width + 1)
        for key, header, width in COLUMNS[1:]:
            self.add_column(header, key=key, width=width)

    def _fit_id_width(self) -> int:
        room = self.scrollable_content_region.width or self.size.width
        return max(MIN_ID_WIDTH, room - sum(width for _, _, width in COLUMNS) - 1)

    def on_resize(self) -> None:
        width = self._fit_id_width()
        if width != self.id_width:
            self.id_width = width
            cursor = self._cursor_request()
            self.clear(columns=True)
            self._add_columns()
            self._order, self._rows = [], set()
            if self._state is not None:
                self.update_rows(self._state, set(self._state.requests), cursor)

    def cells(self, req: RequestInfo) -> tuple:
        return (
            Text("■", style=owner_color(req.color)), RequestId(req.id, self.id_width),
            Text(req.state, style=STATE_STYLES.get(req.state, "")), str(req.prompt), str(req.generated),
            str(len(req.blocks) + len(req.cpu_blocks)), str(req.preemptions),
        )

    def _cursor_request(self) -> str | None:
        if not self.row_count:
            return None
        return self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value

    def update_rows(self, state: MonitorState, dirty: set[str], cursor: str | None = None) -> None:
        """Bring the table up to ``state``: the ``dirty`` requests' rows, then the order if it changed
        (the cursor stays on its request)."""
        self._state = state
        cursor = cursor or self._cursor_request()
        keys = ("color", "request", *(key for key, _, _ in COLUMNS[1:]))
        for rid in dirty:
            req = state.requests.get(rid)
            if req is None:
                if rid in self._rows:
                    self.remove_row(rid)
                    self._rows.discard(rid)
            elif rid in self._rows:
                for key, value in zip(keys, self.cells(req)):
                    self.update_cell(rid, key, value)
            else:
                self.add_row(*self.cells(req), key=rid)
                self._rows.add(rid)
        order = row_order(state)
        if order != self._order:
            position = {rid: i for i, rid in enumerate(order)}
            self.sort("request", key=lambda cell: position.get(cell.rid, len(position)))
            self._order = order
            if cursor in position:
                self.move_cursor(row=position[cursor], animate=False)
