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


def _finished_trace(path):
    """The fixed trace run to its end: both requests done, an end record with the run's counters."""
    import json

    small_trace(path, num_blocks=96)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    last = lines[-1]
    last["stats"].update(finished=2, generated=12, preemptions=0, running=0)
    lines.append({**last, "type": "delta", "seq": last["seq"] + 1, "step": last["step"] + 1, "t": last["t"] + 1,
                  "events": [["request_finish", {"request": "b", "reason": "stop", "generated": 5}]]})
    lines.append({"v": 1, "seq": last["seq"] + 1, "type": "end", "t": last["t"] + 1.5, "step": last["step"] + 1})
    path.write_text("".join(json.dumps(m) + "\n" for m in lines))
    return path


def test_dashboard_after_the_run_says_finished_at_160x50(snap_compare, tmp_path):
    app = MonitorApp(trace=load_replay(_finished_trace(tmp_path / "done.ndjson")), speed=0)
    assert snap_compare(app, terminal_size=(160, 50), run_before=lambda pilot: pilot.pause(0.5))


def test_dashboard_selected_request_highlighted_at_160x50(snap_compare, tmp_path):
    app = MonitorApp(trace=load_replay(small_trace(tmp_path / "fixed.ndjson", num_blocks=1200)), speed=0.001)

    async def run_before(pilot):
        await pilot.press("n", "n", "n", "down")
        await pilot.pause()

    assert snap_compare(app, terminal_size=(160, 50), run_before=run_before)
