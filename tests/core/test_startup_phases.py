"""Start-up phases: one debug line each, in the format benchmarks/e2e/startup.py reads, from a real engine build."""

from __future__ import annotations

import importlib.util
import logging
import time

from repo_paths import ROOT

from pagedkv.core import startup_phases
from pagedkv.testing import tiny_engine


def _bench_module():
    spec = importlib.util.spec_from_file_location("startup_bench", ROOT / "benchmarks" / "e2e" / "startup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_phase_logs_its_time_and_the_time_since_start_in_the_benchmarks_format(caplog):
    with caplog.at_level(logging.DEBUG, logger="pagedkv.startup"):
        with startup_phases.phase("napping"):
            time.sleep(0.05)
        startup_phases.mark("a moment")
    lines = [f"{r.name}: {r.levelname}: {r.getMessage()}" for r in caplog.records]
    found = _bench_module().phases("\n".join(lines))
    assert [name for name, _, _ in found] == ["napping", "a moment"]
    (_, took, at), (_, none, later) = found
    assert 0.05 <= took < 5 and none is None and 0 < at <= later


def test_nothing_is_logged_above_debug(caplog):
    with caplog.at_level(logging.INFO, logger="pagedkv.startup"):
        with startup_phases.phase("quiet"):
            pass
    assert not caplog.records


def test_building_an_engine_logs_each_phase(caplog):
    with caplog.at_level(logging.DEBUG, logger="pagedkv.startup"):
        tiny_engine()
    names = [r.getMessage().split(" (at ")[0].rsplit(" ", 2)[0] for r in caplog.records]
    assert names == ["plugins loaded", "backend 'cpu' started", "model support checked",
                     "KV cache allocated (64 blocks)", "linear layers set to pack at first use", "model runner built"]
