"""Reconnecting: to a different engine run the reducer starts over; to the same run it keeps its history."""

from __future__ import annotations

from pagedkv.monitor.state import MonitorState


def _msg(kind, seq, t, **fields):
    return {"v": 3, "seq": seq, "type": kind, "t": t, **fields}


def _hello(wall, num_blocks=8):
    return _msg("hello", 0, 0.0, num_blocks=num_blocks, block_size=4, num_cpu_blocks=0, backend="torch",
                model="tiny", device="cpu", wall=wall)


def run(state, wall, steps, *, prefix, start=0, rate=10):
    """One engine run's stream as a client sees it on connect: hello, keyframe, then ``steps`` deltas.

    Each step adds request ``{prefix}{i}`` and generates ``rate`` tokens a second (one step per second).
    """
    state.apply(_hello(wall))
    state.apply(_msg("snapshot", start, float(start), step=start, refs=[0] * 8, kept=[], requests=[],
                     stats={"generated": rate * start, "kv_usage": 1.0}))
    for i in range(start + 1, start + steps + 1):
        state.apply(_msg("delta", i, float(i), step=i, progress={},
                         events=[["request_add", {"request": f"{prefix}{i}", "prompt_tokens": 3}]],
                         stats={"generated": rate * i, "kv_usage": 1.0 + i, "waste": 0.0}))


def test_a_reconnect_to_a_different_run_resets_rates_history_and_requests():
    state = MonitorState()
    run(state, 1000.0, 10, prefix="old", rate=50)
    assert state.tokens_per_s > 0 and len(state.history["kv_usage"]) == 11
    state.take_dirty()
    run(state, 2000.0, 3, prefix="new", rate=10)
    assert abs(state.tokens_per_s - 10.0) < 1e-9  # the old run's counters no longer in the window (was 0.0)
    assert list(state.history["kv_usage"]) == [1.0, 2.0, 3.0, 4.0]  # this run's points only
    assert list(state.history["tok_s"])[1:] == [10.0, 10.0, 10.0]
    assert state.peak_tok_s == 10.0  # the rate scale starts again too
    assert sorted(state.requests) == ["new1", "new2", "new3"]
    assert [r.color for r in state.requests.values()] == [0, 1, 2]  # colours are dealt again from the first
    _, _, _, dirty = state.take_dirty()
    assert {f"old{i}" for i in range(1, 11)} <= dirty  # the views drop the old run's rows
    assert state.runs == 2


def test_a_reconnect_to_the_same_run_keeps_history_and_requests():
    state = MonitorState()
    run(state, 1000.0, 5, prefix="r")
    run(state, 1000.0, 3, prefix="r", start=5)  # the same hello again, then the newer keyframe
    assert len(state.history["kv_usage"]) == 10 and state.tokens_per_s == 10.0
    assert sorted(state.requests) == [f"r{i}" for i in range(1, 9)]
    assert state.runs == 1


def test_the_run_id_is_the_hello_start_time_and_pool_so_old_traces_still_read():
    from pagedkv.monitor.state import hello_run_id

    assert hello_run_id(_hello(1.0)) != hello_run_id(_hello(2.0))
    assert hello_run_id(_hello(1.0)) != hello_run_id(_hello(1.0, num_blocks=16))
    old = {k: v for k, v in _hello(1.0).items() if k != "wall"}  # a hello without wall is still one run
    state = MonitorState()
    state.apply(old)
    state.apply(old)
    assert state.runs == 1 and state.num_blocks == 8


def test_the_end_counts_requests_not_samples():
    state = MonitorState()
    state.apply(_hello(1.0))
    state.apply(_msg("snapshot", 0, 0.0, step=0, refs=[0] * 8, kept=[], requests=[], stats={}))
    events = [["request_add", {"request": "a", "prompt_tokens": 3, "n": 3}],
              ["request_add", {"request": "b", "prompt_tokens": 3, "n": 1}]]
    events += [["request_finish", {"request": "a", "reason": "stop", "generated": 2}]] * 3
    events += [["request_finish", {"request": "b", "reason": "stop", "generated": 2}]]
    state.apply(_msg("delta", 1, 1.0, step=1, events=events, progress={}, stats={"finished": 4}))
    assert [state.requests[r].state for r in "ab"] == ["finished", "finished"]
    assert state.finished_requests == 2 and not state.joined_late
    assert [state.requests[r].finished_order for r in "ab"] == [1, 2]


def test_a_monitor_that_joins_mid_run_says_its_count_is_a_lower_bound():
    from pagedkv.monitor.panels import end_summary

    state = MonitorState()
    state.apply(_hello(1.0))
    state.apply(_msg("snapshot", 7, 7.0, step=7, refs=[0] * 8, kept=[], requests=[], stats={"finished": 5}))
    state.apply(_msg("delta", 8, 8.0, step=8, progress={}, stats={"finished": 6},
                     events=[["request_finish", {"request": "z", "reason": "stop"}]]))
    assert state.joined_late and end_summary(state).startswith("at least 1 request finished (6 samples)")


def test_the_finished_requests_kept_are_the_most_recently_finished():
    from pagedkv.monitor.state import MAX_FINISHED

    state = MonitorState()
    state.apply(_hello(1.0))
    state.apply(_msg("snapshot", 0, 0.0, step=0, refs=[0] * 8, kept=[], requests=[], stats={}))
    n = 2 * MAX_FINISHED + 1
    adds = [["request_add", {"request": f"q{i}", "prompt_tokens": 1}] for i in range(n)]
    finishes = [["request_finish", {"request": f"q{i}", "reason": "stop"}] for i in reversed(range(n))]
    state.apply(_msg("delta", 1, 1.0, step=1, progress={}, stats={}, events=adds + finishes))
    state.apply(_msg("delta", 2, 2.0, step=2, progress={}, stats={},  # a new request triggers the trim
                     events=[["request_add", {"request": "last", "prompt_tokens": 1}]]))
    kept = {rid for rid, r in state.requests.items() if r.state == "finished"}
    assert kept == {f"q{i}" for i in range(MAX_FINISHED)}  # finished last (in reverse arrival order)
