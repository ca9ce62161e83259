"""A pytest-textual-snapshot image of the dashboard on a fixed trace (update with --snapshot-update)."""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_textual_snapshot")

from test_monitor import small_trace  # noqa: E402

from pagedkv.monitor.app import MonitorApp, load_replay  # noqa: E402


def test_dashboard_snapshot(snap_compare, tmp_path):
    app = MonitorApp(trace=load_replay(small_trace(tmp_path / "fixed.ndjson", num_blocks=96)), speed=0.001)

    async def run_before(pilot):
        await pilot.press("n", "n", "n")
        app.action_select("a")
        await pilot.pause()

    assert snap_compare(app, terminal_size=(120, 34), run_before=run_before)
