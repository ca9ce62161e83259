"""How fast `engine simulate` plans: ShareGPT-like requests through the real scheduler and allocator.

Run: ``python -m pytest benchmarks/micro/test_simulate_speed.py --benchmark-only -s``.

- ``test_sharegpt_100k``: issue 9's target, 100,000 ShareGPT-like requests "well under a
  minute", for the paged run and the static baseline, and for ``simulate()`` as a whole (both
  runs and the report: what ``engine simulate --num-requests 100000`` does).
  ``PAGEDKV_SIM_BENCH_REQUESTS`` changes the size.
- ``test_lane_speedup``: the baseline measured in the same session, the same smaller workload
  stepped one sequence at a time (``decode_lane=False``) and with the decode lane, plain and with
  prefix caching on a shared-system-prompt workload; the ratio is the speed-up, and the figures of
  both runs must be identical.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest

from pagedkv.sim.simulate import SimSetup, run_once, simulate
from pagedkv.sim.workload import builtin_workload

N = int(os.environ.get("PAGEDKV_SIM_BENCH_REQUESTS", "100000"))
BASELINE_N = int(os.environ.get("PAGEDKV_SIM_BASELINE_REQUESTS", "5000"))
SETUP = SimSetup(num_blocks=200_000, max_num_seqs=256)  # SmolLM2-135M's shape, bf16: 200k blocks = 4.7 GiB


def _load() -> str:
    load = os.getloadavg()
    return f"loadavg {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, {os.cpu_count()} CPUs"


@pytest.fixture(scope="module")
def workload():
    started = time.perf_counter()
    wl = builtin_workload("sharegpt", N, seed=0)
    print(f"\nbuilt {N} ShareGPT-like requests in {time.perf_counter() - started:.2f} s")
    return wl


@pytest.mark.parametrize("what", ["paged", "static", "simulate() paged+static"])
def test_sharegpt_100k(benchmark, workload, what):
    results = []

    def once():
        if what.startswith("simulate"):
            report = simulate(workload, SETUP)
            results.append(report["paged"])
        else:
            results.append(run_once(workload, replace(SETUP, allocator=what), series=False))

    benchmark.pedantic(once, rounds=1, iterations=1)
    r = results[-1]
    wall = benchmark.stats.stats.max
    per_token_us = wall / r["generated_tokens"] * 1e6
    benchmark.extra_info.update(
        requests=N, steps=r["steps"], generated_tokens=r["generated_tokens"], wall_s=round(wall, 2),
        us_per_generated_token=round(per_token_us, 3), load=_load(),
    )
    print(
        f"\nsimulate sharegpt x{N}, {what}: {wall:.2f} s, {r['steps']} steps, {r['generated_tokens']} generated "
        f"tokens, {per_token_us:.3f} us/token ({_load()})"
    )
    assert r["finished"] == N


@pytest.mark.parametrize("case", ["sharegpt", "shared-prefix + prefix caching"])
def test_lane_speedup(benchmark, case):
    wl = builtin_workload(case.split()[0], BASELINE_N, seed=1)
    setup = replace(SETUP, enable_prefix_caching=case.endswith("caching"))
    runs = {}

    def both():
        for lane in (False, True):
            runs[lane] = run_once(wl, replace(setup, decode_lane=lane), series=False)

    benchmark.pedantic(both, rounds=1, iterations=1)
    stepped, laned = runs[False], runs[True]
    ratio = stepped["wall_s"] / laned["wall_s"]
    tokens = laned["generated_tokens"]
    benchmark.extra_info.update(
        requests=BASELINE_N, one_by_one_s=round(stepped["wall_s"], 2), lane_s=round(laned["wall_s"], 2),
        speedup=round(ratio, 2), load=_load(),
    )
    print(
        f"\nsimulate {case} x{BASELINE_N}: one by one {stepped['wall_s']:.2f} s "
        f"({stepped['wall_s'] / tokens * 1e6:.2f} us/token), decode lane {laned['wall_s']:.2f} s "
        f"({laned['wall_s'] / tokens * 1e6:.2f} us/token): {ratio:.1f}x ({_load()})"
    )
    for key in stepped:
        if key != "wall_s":
            assert laned[key] == stepped[key], key
