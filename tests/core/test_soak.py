"""A short soak: every plugin on, mixed n, aborts; nothing leaks, nothing goes missing."""

from __future__ import annotations

import importlib.util

from repo_paths import ROOT


def load_soak():
    path = ROOT / "benchmarks" / "e2e" / "soak.py"
    spec = importlib.util.spec_from_file_location("pagedkv_soak", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_short_soak_leaks_nothing_and_finishes_every_request():
    report = load_soak().soak(requests=40, seed=3)
    assert report["requests_submitted"] == 40
    assert report["requests_missing"] == 0
    assert report["requests_completed"] + report["requests_aborted"] == 40
    assert report["blocks_leaked"] == 0 and report["cpu_blocks_leaked"] == 0
    assert report["preemptions"] > 0, "the pool is meant to be small enough to preempt"
