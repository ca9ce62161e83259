"""The Textual dashboard, driven through Pilot: keys, cells, selection, banners, and a live engine."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest

pytest.importorskip("textual")

from conftest import random_prompts  # noqa: E402
from pagedkv.monitor.app import MonitorApp, load_replay  # noqa: E402
from pagedkv.monitor.blockmap import BlockMap, owner_color  # noqa: E402
from pagedkv.monitor.state import MonitorState  # noqa: E402

SIZE = (120, 36)


def _msg(kind, seq, t, **fields):
    return {"v": 1, "seq": seq, "type": kind, "t": t, **fields}


def small_trace(path, num_blocks=12):
    """A fixed, hand-written trace: two requests, a shared block, a cached one; one step per second."""
    msgs = [
        _msg("hello", 0, 0.0, num_blocks=num_blocks, block_size=4, num_cpu_blocks=4, backend="torch",
             model="tiny-test", device="cpu"),
        _msg("snapshot", 0, 0.0, step=0, refs=[0] * num_blocks, kept=[], requests=[], stats={}),
    ]
    steps = [
        [["request_add", {"request": "a", "prompt_tokens": 7, "n": 1}],
         ["request_add", {"request": "b", "prompt_tokens": 5, "n": 1}],
         ["block_alloc", {"block": 0, "owner": "a"}], ["block_alloc", {"block": 1, "owner": "a"}],
         ["request_schedule", {"request": "a", "tokens": 7}]],
        [["block_share", {"block": 0, "refs": 2, "owner": "b"}], ["block_alloc", {"block": 2, "owner": "b"}],
         ["request_schedule", {"request": "b", "tokens": 1}]],
        [["block_alloc", {"block": 3, "owner": "a"}], ["block_swap_out", {"block": 2, "cpu_block": 1, "owner": "b"}],
         ["block_free", {"block": 2}], ["block_unshare", {"block": 0, "refs": 1, "owner": "b"}]],
        [["request_finish", {"request": "a", "reason": "length"}], ["block_free", {"block": 3}],
         ["block_free", {"block": 1}], ["block_keep", {"block": 0}]],
    ]
    for i, events in enumerate(steps, start=1):
        stats = {"kv_usage": 10.0 * i, "waste": 5.0 * i, "generated": 3 * i, "running": 1, "waiting": 0}
        msgs.append(_msg("delta", i, float(i), step=i, events=events, stats=stats, progress={}))
    path.write_text("".join(json.dumps(m) + "\n" for m in msgs))
    return path


def run_app(app, body, size=SIZE):
    async def main():
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            await body(pilot)

    asyncio.run(main())


def test_the_grid_shows_the_right_cells_for_a_small_trace(tmp_path):
    app = MonitorApp(trace=load_replay(small_trace(tmp_path / "t.ndjson")), speed=0)

    async def body(pilot):
        await pilot.pause(0.3)
        gpu, cpu = app.query_one("#gpu", BlockMap), app.query_one("#cpu", BlockMap)
        assert app.state.step == 4 and "end of replay" in app.banner_text
        assert [gpu.cell(b)[0] for b in range(5)] == ["cached", "free", "free", "free", "free"]
        assert [gpu.cell_text(b) for b in range(3)] == ["□ ", "· ", "· "]
        assert cpu.display and cpu.cell(1) == ("swapped", owner_color(1), None) and cpu.cell_text(1) == "■ "
        assert gpu.render_line(0).text.startswith("□ · · ")
        table = app.query_one("#requests")
        assert table.row_count == 2 and str(table.get_cell("a", "state")) == "finished"

    run_app(app, body)


def test_keys_pause_step_and_quit(tmp_path):
    app = MonitorApp(trace=load_replay(small_trace(tmp_path / "t.ndjson")), speed=0.001)  # one step per ~17 min

    async def body(pilot):
        gpu = app.query_one("#gpu", BlockMap)
        assert app.state.seq == 0
        await pilot.press("p")
        assert app.paused
        await pilot.press("n")
        assert app.state.seq == 1 and gpu.cell(0)[:2] == ("used", owner_color(0))
        await pilot.press("n")
        assert app.state.seq == 2 and gpu.cell(0)[0] == "shared" and gpu.cell_text(0) == "◆ "
        assert app.query_one("#requests").row_count == 2
        await pilot.press("escape", "p")
        assert not app.paused
        await pilot.press("q")
        await pilot.pause()
        assert not app.is_running

    run_app(app, body)


def test_selecting_a_request_highlights_its_blocks_and_lists_its_table(tmp_path):
    app = MonitorApp(trace=load_replay(small_trace(tmp_path / "t.ndjson")), speed=0.001)

    async def body(pilot):
        await pilot.press("n", "n", "n")  # a holds 0, 1, 3; b holds 0 (shared) and a swapped block
        gpu = app.query_one("#gpu", BlockMap)
        assert gpu.cell_text(1) == "■ "  # nothing selected: every block in its owner's look
        app.action_select("a")
        assert [gpu.cell_text(b) for b in (0, 1, 3)] == ["██"] * 3
        assert gpu.cell_text(2) == "· " and gpu._segment(2).style.dim  # the rest steps back
        mapping = str(app.query_one("#mapping").render())
        assert "3 blocks" in mapping and "0→0  1→1  2→3" in mapping
        await pilot.press("down")  # arrows move the selection with no focus change first
        assert app.selected == "b" and [gpu.cell_text(b) for b in (0, 1, 3)] == ["■ "] * 3  # a's now dimmed
        assert "0 blocks + 1 swapped" in str(app.query_one("#mapping").render())
        await pilot.press("up")
        assert app.selected == "a"
        await pilot.press("escape")
        assert app.selected is None and gpu.cell_text(1) == "■ " and str(app.query_one("#mapping").render()) == ""

    run_app(app, body)


def test_mapping_stays_readable_past_index_9_and_100():
    from pagedkv.monitor.panels import mapping_text
    from pagedkv.monitor.state import RequestInfo

    req = RequestInfo("7", 0, blocks=list(range(500, 620)))
    text = mapping_text(req).plain
    assert "9→509  10→510  11→511" in text and "99→599  100→600" in text and "119→619" in text


def test_title_shows_the_model_name_not_its_cache_path():
    from pagedkv.monitor.panels import model_name

    assert model_name("/root/.cache/pagedkv/models/SmolLM2-135M-Instruct-286ffa1abfe7") == "SmolLM2-135M-Instruct"
    assert model_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "SmolLM2-135M-Instruct"
    assert model_name("simulated") == "simulated"


def test_a_truncated_trace_shows_an_error_banner_naming_the_line(tmp_path):
    path = small_trace(tmp_path / "t.ndjson")
    data = path.read_bytes()
    path.write_bytes(data[:-30])
    app = MonitorApp(trace=load_replay(path), speed=0)

    async def body(pilot):
        await pilot.pause(0.2)
        assert app.banner_kind == "error" and "t.ndjson line 6" in app.banner_text
        assert app.state.step == 3  # what came before the bad line is shown

    run_app(app, body)


def test_a_message_that_contradicts_the_state_stops_the_replay_with_a_banner(tmp_path):
    path = small_trace(tmp_path / "t.ndjson")
    lines = path.read_text().splitlines()
    bad = json.loads(lines[3])
    bad["events"] = [["block_alloc", {"block": 99, "owner": "x"}]]
    lines[3] = json.dumps(bad)
    path.write_text("\n".join(lines) + "\n")
    app = MonitorApp(trace=load_replay(path), speed=0)

    async def body(pilot):
        await pilot.pause(0.2)
        assert app.failed and "line 4" in app.banner_text and "out of range" in app.banner_text

    run_app(app, body)


class FakeEngine:
    """Serves a fixed stream on a Unix socket, then hangs up (a stand-in for an engine that exits)."""

    def __init__(self, path, lines):
        self.path, self.lines = str(path), lines
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.path)
        self.server.listen(1)
        self.go_away = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        conn, _ = self.server.accept()
        conn.sendall("".join(json.dumps(m) + "\n" for m in self.lines).encode())
        self.go_away.wait(10)
        conn.close()
        self.server.close()


def test_the_disconnect_banner_appears_and_the_last_state_is_greyed(tmp_path):
    trace = small_trace(tmp_path / "t.ndjson")
    lines = [json.loads(line) for line in trace.read_text().splitlines()][:4]
    fake = FakeEngine(tmp_path / "e.sock", lines)
    app = MonitorApp(connect=f"unix:{tmp_path / 'e.sock'}")

    async def body(pilot):
        gpu = app.query_one("#gpu", BlockMap)
        for _ in range(50):
            await pilot.pause(0.05)
            if app.state.seq == 2:
                break
        assert app.state.seq == 2 and app.banner_text == "" and not gpu.greyed
        fake.go_away.set()
        for _ in range(50):
            await pilot.pause(0.05)
            if "disconnected" in app.banner_text:
                break
        assert app.banner_kind == "error" and "engine disconnected" in app.banner_text
        assert "retrying" in app.banner_text and gpu.greyed
        assert gpu.cell(0)[0] == "shared"  # the last state is still shown

    run_app(app, body)


def test_a_run_that_ends_shows_run_finished_with_its_summary_not_an_error(tmp_path):
    trace = small_trace(tmp_path / "t.ndjson")
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    lines[-1]["stats"].update(finished=2, generated=12, preemptions=0)
    lines[-1]["events"].append(["request_finish", {"request": "b", "reason": "stop"}])
    lines.append(_msg("end", len(lines) - 2, 5.0, step=4))
    fake = FakeEngine(tmp_path / "e.sock", lines)
    app = MonitorApp(connect=f"unix:{tmp_path / 'e.sock'}")

    async def body(pilot):
        for _ in range(60):
            await pilot.pause(0.05)
            if app.state.ended:
                break
        await pilot.pause(0.2)
        assert app.banner_kind == "info" and "run finished: 2 requests finished, 12 tokens" in app.banner_text
        fake.go_away.set()
        for _ in range(20):
            await pilot.pause(0.05)
        assert app.banner_kind == "info" and "run finished" in app.banner_text  # the hang-up is no error

    run_app(app, body)


def test_before_the_engine_is_up_the_monitor_says_it_is_waiting(tmp_path):
    app = MonitorApp(connect=f"unix:{tmp_path / 'absent.sock'}")

    async def body(pilot):
        await pilot.pause(0.3)
        assert app.banner_kind == "warn" and f"waiting for the engine at unix:{tmp_path}" in app.banner_text
        assert app.query_one("#kv").data == []  # no data yet: an empty sparkline, not a solid bar

    run_app(app, body)


def test_only_dirty_rows_are_redrawn_on_a_16k_block_map(tmp_path):
    n = 16384
    msgs = [_msg("hello", 0, 0.0, num_blocks=n, block_size=16, backend="torch", model="m"),
            _msg("snapshot", 0, 0.0, step=0, refs=[0] * n, kept=[], requests=[], stats={})]
    for i in range(1, 31):
        events = [["block_alloc", {"block": (i * 997 + j * 131) % n, "owner": str(i % 7)}] for j in range(8)]
        msgs.append(_msg("delta", i, i * 0.1, step=i, events=events, stats={"kv_usage": i}))
    path = tmp_path / "big.ndjson"
    path.write_text("".join(json.dumps(m) + "\n" for m in msgs))
    app = MonitorApp(trace=load_replay(path), speed=0.001)

    async def body(pilot):
        gpu = app.query_one("#gpu", BlockMap)
        await pilot.pause()
        before = gpu.rows_built
        for _ in range(30):
            await pilot.press("n")
        assert app.state.seq == 30
        # the work is bounded by what changed, not by the map's size (speed itself belongs in benchmarks)
        assert gpu.rows_built - before <= 30 * 8, "only rows holding changed blocks are rebuilt"

    run_app(app, body, size=(160, 50))


def test_live_monitor_of_a_real_engine_ends_with_the_engine_block_map(tiny_llama, tmp_path):
    from pagedkv.core.config import EngineConfig
    from pagedkv.core.engine import Engine
    from pagedkv.core.sample.sampling_params import SamplingParams
    from pagedkv.plugins import telemetry

    sock = tmp_path / "engine.sock"
    engine = Engine(
        EngineConfig(device="cpu", num_blocks=24, block_size=4, telemetry=f"unix:{sock}",
                     plugin_options={"telemetry": {"keyframe_steps": 1000, "keyframe_s": 1e9}}),
        model=tiny_llama,
    )
    app = MonitorApp(connect=f"unix:{sock}")
    done = threading.Event()

    def work():
        for prompt in random_prompts([9, 14, 6, 11], seed=9):
            engine.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
        for _ in range(6):
            engine.step()
        done.set()

    async def body(pilot):
        for _ in range(100):
            await pilot.pause(0.05)
            if app.state.synced:
                break
        worker = threading.Thread(target=work)
        worker.start()
        while not done.is_set():
            await pilot.pause(0.05)
        worker.join()
        seq = telemetry.find(engine).seq
        for _ in range(100):
            await pilot.pause(0.05)
            if app.state.seq == seq:
                break
        assert app.state.seq == seq and app.state.gaps == 0
        expected = telemetry.engine_block_map(engine)
        assert any(s != "free" for s, _, _ in expected)
        assert app.state.block_map() == expected
        assert app.state.request_tables() == telemetry.engine_request_tables(engine)
        gpu = app.query_one("#gpu", BlockMap)
        assert sum(gpu.cell(b)[0] != "free" for b in range(24)) == sum(s != "free" for s, _, _ in expected)

    try:
        run_app(app, body)
    finally:
        telemetry.close(engine)


def test_reducer_needs_no_textual():
    assert "textual" not in MonitorState.__module__
