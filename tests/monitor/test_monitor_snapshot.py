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


def _run_stream(wall, steps, rate, prefix, kv_step):
    """A live engine run as a client gets it: hello, keyframe, ``steps`` deltas (one per second)."""
    from test_monitor import _msg

    msgs = [_msg("hello", 0, 0.0, num_blocks=64, block_size=4, num_cpu_blocks=0, backend="torch",
                 model="tiny-test", device="cpu", wall=wall),
            _msg("snapshot", 0, 0.0, step=0, refs=[0] * 64, kept=[], requests=[], stats={})]
    for i in range(1, steps + 1):
        events = [["request_add", {"request": f"{prefix}{i}", "prompt_tokens": 4}],
                  ["block_alloc", {"block": i, "owner": f"{prefix}{i}"}],
                  ["request_schedule", {"request": f"{prefix}{i}"}]]
        stats = {"kv_usage": kv_step * i, "waste": 2.0, "generated": rate * i, "running": i, "waiting": 0}
        msgs.append(_msg("delta", i, float(i), step=i, events=events, stats=stats, progress={}))
    return msgs


def test_after_reconnecting_to_a_new_run_the_dashboard_shows_only_that_run(snap_compare, tmp_path, monkeypatch):
    """Run A (200 tokens/s, 8 requests) goes away; run B (20 tokens/s, 3 requests) starts on the same socket.

    Before the fix tokens/s read 0.0 and the sparklines and table still held run A.
    """
    import asyncio

    from test_monitor import FakeEngine

    monkeypatch.chdir(tmp_path)  # a relative socket path: the subtitle is the same on every machine
    engines = [FakeEngine("e.sock", _run_stream(1000.0, 8, 200, "old", 10.0))]
    app = MonitorApp(connect="unix:e.sock")

    async def wait_for(condition):
        for _ in range(200):
            await asyncio.sleep(0.05)
            if condition():
                return
        raise AssertionError(f"timed out: {app.banner_text!r}")

    async def run_before(pilot):
        await wait_for(lambda: app.state.step == 8 and app.banner_text == "")
        app.action_select("old3")
        engines[0].go_away.set()
        await wait_for(lambda: "disconnected" in app.banner_text)
        engines[0].thread.join(5)
        (tmp_path / "e.sock").unlink()
        engines.append(FakeEngine("e.sock", _run_stream(2000.0, 3, 20, "new", 10.0)))
        await wait_for(lambda: "new3" in app.state.requests and app.state.step == 3 and app.banner_text == "")
        await pilot.pause(0.2)
        assert app.state.tokens_per_s == 20.0 and sorted(app.state.requests) == ["new1", "new2", "new3"]
        assert app.query_one("#requests").row_count == 3
        assert app.selected is None  # the old run's request is not carried over

    try:
        assert snap_compare(app, terminal_size=(120, 34), run_before=run_before)
    finally:
        for engine in engines:
            engine.go_away.set()


def test_the_status_line_at_80_columns(snap_compare, tmp_path):
    """The narrowest side panel: the counters break between items, continuation lines indented."""
    from test_monitor_panels import _trace

    stats = {"running": 16, "waiting": 30, "swapped": 12, "finished": 340, "prefix_hit_rate": 0.085, "cow": 3,
             "swap_out": 27, "swap_in": 9, "evicted": 4, "preemptions": 2, "kv_usage": 40.0, "generated": 50}
    app = MonitorApp(trace=load_replay(_trace(tmp_path / "t.ndjson", [([], stats)])), speed=0)
    assert snap_compare(app, terminal_size=(80, 30), run_before=lambda pilot: pilot.pause(0.5))
