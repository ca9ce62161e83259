"""How fast `engine simulate` plans: ShareGPT-like requests through the real scheduler and allocator.

Run: ``python -m pytest benchmarks/test_simulate_speed.py --benchmark-only -s``.
``PAGEDKV_SIM_BENCH_REQUESTS`` (default 2000) sets the size; the target of issue 9 is
100k requests "well under a minute", so the test prints the measured per-token cost and
the extrapolation to 100k (the cost is linear in generated tokens: one scheduler and
update pass per running sequence per step), with the load average next to it.
"""

from __future__ import annotations

import os

import pytest

from pagedkv.core.simulate import SimSetup, run_once
from pagedkv.core.workload import builtin_workload

N = int(os.environ.get("PAGEDKV_SIM_BENCH_REQUESTS", "2000"))


@pytest.mark.parametrize("max_num_seqs", [128, 256])
def test_sharegpt_paged(benchmark, max_num_seqs):
    wl = builtin_workload("sharegpt", N, seed=0)
    setup = SimSetup(kv_cache_memory="8GiB", max_num_seqs=max_num_seqs, max_num_batched_tokens=4096)
    results = []

    def once():
        results.append(run_once(wl, setup, series=False))

    benchmark.pedantic(once, rounds=1, iterations=1)
    r = results[-1]
    tokens = r["generated_tokens"] + r["prefill_tokens_computed"]
    per_token_us = r["wall_s"] / r["generated_tokens"] * 1e6
    per_100k = per_token_us * 1e-6 * r["generated_tokens"] / N * 100_000
    load = os.getloadavg()
    benchmark.extra_info.update(
        requests=N, steps=r["steps"], generated_tokens=r["generated_tokens"], tokens_touched=tokens,
        wall_s=round(r["wall_s"], 3), us_per_generated_token=round(per_token_us, 3),
        extrapolated_100k_s=round(per_100k, 1), loadavg=load,
    )
    print(
        f"\nsimulate sharegpt x{N} (max_num_seqs {max_num_seqs}): {r['wall_s']:.2f} s, {r['steps']} steps, "
        f"{r['generated_tokens']} generated tokens, {per_token_us:.2f} us/token -> 100k requests ~{per_100k:.0f} s "
        f"(loadavg {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, {os.cpu_count()} CPUs)"
    )
    assert r["finished"] == N
