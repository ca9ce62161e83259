"""The side panels: the status line, fixed-scale sparklines, the legend's colours, the request table, the end banner."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("textual")

from test_monitor import _msg, run_app  # noqa: E402

from pagedkv.monitor.app import MonitorApp, load_replay  # noqa: E402
from pagedkv.monitor.blockmap import BlockMap, owner_color  # noqa: E402

LABELS = ("running", "waiting", "swapped", "finished", "prefix hit", "CoW", "swap out/in", "evicted",
          "preemptions", "step", "seq")


def _trace(path, steps, num_blocks=16, hello=None):
    """hello + keyframe + one delta per ``steps`` item: ``(events, stats)``, one step per second."""
    msgs = [_msg("hello", 0, 0.0, num_blocks=num_blocks, block_size=4, num_cpu_blocks=4, backend="torch",
                 model="tiny-test", device="cpu", wall=1.0, **(hello or {})),
            _msg("snapshot", 0, 0.0, step=0, refs=[0] * num_blocks, kept=[], requests=[], stats={})]
    for i, (events, stats) in enumerate(steps, start=1):
        msgs.append(_msg("delta", i, float(i), step=i, events=events, stats=stats, progress={}))
    path.write_text("".join(json.dumps(m) + "\n" for m in msgs))
    return path


def _lines(widget):
    return [widget.render_line(y).text.rstrip() for y in range(widget.size.height)]


@pytest.mark.parametrize("width", [16, 22, 30, 41, 48, 60])
def test_the_status_line_never_runs_labels_together(width):
    from pagedkv.monitor.panels import status_text
    from pagedkv.monitor.state import MonitorState

    state = MonitorState()
    state.stats = {"running": 6, "waiting": 0, "swapped": 12, "finished": 340, "prefix_hit_rate": 0.085,
                   "cow": 3, "swap_out": 27, "swap_in": 9, "evicted": 4, "preemptions": 2}
    state.step, state.seq = 1234, 1240
    lines = status_text(state, True, width).plain.split("\n")
    item = "(?:" + "|".join(re.escape(label) for label in LABELS) + r") \S+"
    for line in lines:  # every line holds whole items: a label and its value are never split
        assert re.fullmatch(rf"(  )?{item}(  {item})*(   PAUSED )?|   PAUSED ", line), (width, line)
        assert len(line) <= max(width, 2 + max(len(x) for x in line.split("  ") if x)), (width, line)
    joined = "".join(lines)  # a copy of the screen with its lines joined still reads: each group stays whole
    for group in ("running 6  waiting 0  swapped 12  finished 340",
                  "prefix hit 8.5%  CoW 3  swap out/in 27/9  evicted 4", "preemptions 2  step 1234  seq 1240"):
        assert group in joined, (width, lines)


def test_one_percent_kv_usage_draws_a_low_bar_not_a_full_one(tmp_path):
    steps = [([], {"kv_usage": 0.5 + 0.5 * (i % 2), "waste": 0.5, "generated": 10 * i}) for i in range(1, 7)]
    app = MonitorApp(trace=load_replay(_trace(tmp_path / "t.ndjson", steps)), speed=0)

    async def body(pilot):
        await pilot.pause(0.3)
        top, bottom = _lines(app.query_one("#kv"))
        assert top.strip() == "" and set(bottom.strip()) == {"▁"}  # 0.5-1% of a 0-100% scale: the lowest eighth
        toks = _lines(app.query_one("#toks"))  # a steady 10 tokens/s on its own scale (0-10): full bars
        assert set(toks[0].strip()) == {"█"}

    run_app(app, body)


def test_the_rate_scale_only_grows_so_a_slow_step_after_a_peak_stays_low(tmp_path):
    generated, steps = 0, []
    for rate in (500, 500, 10, 10, 10, 10):
        generated += rate
        steps.append(([], {"kv_usage": 50.0, "generated": generated}))
    app = MonitorApp(trace=load_replay(_trace(tmp_path / "t.ndjson", steps)), speed=0)

    async def body(pilot):
        await pilot.pause(0.3)
        assert app.state.peak_tok_s == 500.0 and "scale 0-500" in str(app.query_one("#toks-label").render())
        toks = app.query_one("#toks")
        top, bottom = (toks.render_line(y).text for y in (0, 1))
        last = len(app.state.history["tok_s"]) - 1
        assert top[1] == "█" and top[last] == " " and bottom[last] != " "  # ~10/s after the peak: a low bar
        kv_top, kv_bottom = _lines(app.query_one("#kv"))
        assert kv_top.strip() == "" and set(kv_bottom.strip()) == {"█"}  # 50% fills the lower of two rows

    run_app(app, body)


def test_the_legend_draws_used_and_swapped_in_the_owner_colour_as_the_grids_do(tmp_path):
    steps = [([["request_add", {"request": "a", "prompt_tokens": 4}], ["block_alloc", {"block": 0, "owner": "a"}],
               ["block_alloc", {"block": 1, "owner": "a"}],
               ["block_swap_out", {"block": 1, "cpu_block": 2, "owner": "a"}], ["block_free", {"block": 1}]],
              {"kv_usage": 6.0})]
    app = MonitorApp(trace=load_replay(_trace(tmp_path / "t.ndjson", steps)), speed=0)

    async def body(pilot):
        await pilot.pause(0.3)
        from pagedkv.monitor.panels import legend as make_legend

        legend = make_legend()  # what the #legend panel shows
        plain = legend.plain

        def glyph_color(label):
            at = plain.index(f" {label}") - 1
            return next(str(span.style).split()[-1] for span in legend.spans if span.start <= at < span.end)

        gpu, cpu = app.query_one("#gpu", BlockMap), app.query_one("#cpu", BlockMap)
        assert gpu.cell(0)[:2] == ("used", owner_color(0)) and cpu.cell(2)[:2] == ("swapped", owner_color(0))
        assert glyph_color("used/swapped (owner)") == owner_color(0)  # one entry, the owner's colour

    run_app(app, body)


def test_the_end_banner_counts_an_n3_request_as_one_request_of_three_samples(tmp_path):
    events = [["request_add", {"request": "a", "prompt_tokens": 4, "n": 3}]]
    events += [["request_finish", {"request": "a", "reason": "stop", "generated": 2}]] * 3
    path = _trace(tmp_path / "t.ndjson", [(events, {"finished": 3, "generated": 6})])
    with path.open("a") as f:
        f.write(json.dumps(_msg("end", 1, 2.0, step=1)) + "\n")
    app = MonitorApp(trace=load_replay(path), speed=0)

    async def body(pilot):
        await pilot.pause(0.3)
        assert "run finished: 1 request finished (3 samples), 6 tokens" in app.banner_text

    run_app(app, body)


def _many_requests(path, server_ids):
    """Six requests: two finish (f1 then f2), one is swapped, one waits, two run."""
    ids = {k: (f"cmpl-{k * 8}{'0' * 24}-0" if server_ids else k) for k in ("f1", "r1", "w1", "s1", "r2", "f2")}
    add = [["request_add", {"request": ids[k], "prompt_tokens": 4}] for k in ids]
    run = [["request_schedule", {"request": ids[k]}] for k in ("f1", "r1", "s1", "r2", "f2")]
    done = [["request_finish", {"request": ids["f1"], "reason": "stop"}],
            ["request_swap_out", {"request": ids["s1"]}],
            ["request_finish", {"request": ids["f2"], "reason": "stop"}]]
    return ids, _trace(path, [(add, {}), (run, {}), (done, {})])


def test_the_table_lists_running_then_waiting_and_swapped_then_the_newest_finished(tmp_path):
    ids, path = _many_requests(tmp_path / "t.ndjson", server_ids=False)
    app = MonitorApp(trace=load_replay(path), speed=0)

    async def body(pilot):
        await pilot.pause(0.3)
        table = app.query_one("#requests")
        rows = [table.coordinate_to_cell_key((r, 0)).row_key.value for r in range(table.row_count)]
        assert rows == ["r1", "r2", "w1", "s1", "f2", "f1"]
        await pilot.press("down", "down")  # the selection follows its request when the order changes
        assert app.selected == "r2"

    run_app(app, body)


def test_server_request_ids_are_shortened_and_every_column_stays_on_screen(tmp_path):
    ids, path = _many_requests(tmp_path / "t.ndjson", server_ids=True)
    app = MonitorApp(trace=load_replay(path), speed=0)

    async def body(pilot):
        await pilot.pause(0.3)
        table = app.query_one("#requests")
        header = table.render_line(0).text
        assert header.split() == ["id", "state", "prompt", "gen", "blk", "pre"]
        assert header.rstrip().endswith("pre")
        first = table.render_line(1).text
        assert "…" in first and first.split()[1].endswith("000-0") and first.split()[-1] == "0"
        assert table.virtual_size.width <= table.scrollable_content_region.width  # no sideways scrolling

    run_app(app, body)


def test_at_80_columns_the_status_lines_hold_whole_items(tmp_path):
    stats = {"running": 16, "waiting": 30, "swapped": 12, "finished": 340, "prefix_hit_rate": 0.085, "cow": 3,
             "swap_out": 27, "swap_in": 9, "evicted": 4, "preemptions": 2}
    app = MonitorApp(trace=load_replay(_trace(tmp_path / "t.ndjson", [([], stats)])), speed=0)

    async def body(pilot):
        await pilot.pause(0.3)
        lines = [line.strip() for line in _lines(app.query_one("#counters")) if line.strip()]
        item = "(?:" + "|".join(re.escape(label) for label in LABELS) + r") \S+"
        assert all(re.fullmatch(rf"{item}(  {item})*", line) for line in lines), lines
        assert "running 16  waiting 30" in "  ".join(lines)

    run_app(app, body, size=(80, 30))
