"""A simulated run's trace is stamped in simulated seconds, so a replay's --speed is relative to the simulation."""

from __future__ import annotations

from pagedkv.core.trace import read_trace
from pagedkv.sim.simulate import SimSetup, run_once
from pagedkv.sim.workload import builtin_workload


def test_trace_times_are_simulated_seconds_from_zero_to_the_end_of_the_run(tmp_path):
    path = tmp_path / "sim.ndjson"
    workload = builtin_workload("alpaca", 40, seed=1, request_rate=50.0)
    result = run_once(workload, SimSetup(num_blocks=256, trace=str(path)))
    messages = read_trace(path).messages
    times = [m["t"] for m in messages]
    assert times[0] == 0.0 and times == sorted(times)  # monotone, from the simulated start
    deltas = [m for m in messages if m["type"] == "delta"]
    assert len(deltas) == result["steps"]
    # the last step starts before the simulated end and after the last arrival
    last_arrival = max(r.arrival for r in workload.requests)
    assert last_arrival <= deltas[-1]["t"] < result["sim_time_s"] + workload.requests[0].arrival + 1e-9
    step_ms = [m["stats"]["step_ms"] for m in deltas[1:]]
    assert all(ms >= 0 for ms in step_ms) and max(ms for ms in step_ms) < 10_000  # simulated step times, not wall
