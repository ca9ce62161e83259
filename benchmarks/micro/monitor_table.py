"""What keeping the monitor's request table in order costs per tick, when one request finishes every tick.

Three ways, interleaved round by round in one run (thread CPU time, median ms per tick):

- ``cells``: update the finished request's cells in place, rows left in arrival order (main before issue 26);
- ``rebuild``: clear the table and add every row again in the new order;
- ``sort``: :class:`~pagedkv.monitor.request_table.RequestTable` (cells in place, then ``DataTable.sort``).

    .venv/bin/python benchmarks/micro/monitor_table.py [--finished 500] [--running 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

TICKS = 20


def make_state(finished: int, running: int):
    from pagedkv.monitor.state import MonitorState

    state = MonitorState()
    for i in range(finished + running):
        state._request(f"cmpl-{i:032x}-0").state = "running"
    for rid in list(state.requests)[:finished]:
        state._finished(state.requests[rid])
    return state


def tick_cells(table, state, req) -> None:
    for key, value in zip(("color", "request", "state", "prompt", "gen", "blocks", "preempt"), table.cells(req)):
        table.update_cell(req.id, key, value)


def tick_rebuild(table, state, req) -> None:
    from pagedkv.monitor.request_table import row_order

    table.clear()
    for rid in row_order(state):
        table.add_row(*table.cells(state.requests[rid]), key=rid)


def tick_sort(table, state, req) -> None:
    table.update_rows(state, {req.id})


async def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    from textual.app import App

    from pagedkv.monitor.request_table import RequestTable

    class Bench(App):
        def compose(self):
            yield RequestTable(id="t")

    results: dict[str, list[float]] = {"cells": [], "rebuild": [], "sort": []}
    async with Bench().run_test(size=(120, 40)) as pilot:
        table = pilot.app.query_one("#t")
        for _ in range(args.rounds):
            for name, tick in (("cells", tick_cells), ("rebuild", tick_rebuild), ("sort", tick_sort)):
                state = make_state(args.finished, args.running + TICKS)
                table.clear()
                table._order, table._rows = [], set()
                table.update_rows(state, set(state.requests))
                await pilot.pause()
                running = [r for r in state.requests.values() if r.state == "running"][:TICKS]
                start = time.thread_time()
                for req in running:
                    state._finished(req)
                    tick(table, state, req)
                results[name].append((time.thread_time() - start) / TICKS * 1e3)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--finished", type=int, default=500)
    parser.add_argument("--running", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    results = asyncio.run(measure(args))
    base = statistics.median(results["cells"])
    print(f"{args.finished + args.running + TICKS} rows, one finish per tick, median of {args.rounds} rounds:")
    for name, values in results.items():
        median = statistics.median(values)
        print(f"  {name:8s} {median:7.2f} ms/tick  ({median / base:5.1f}x cells)")


if __name__ == "__main__":
    main()
