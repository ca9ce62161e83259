"""benchmarks/serving/hostile_client.py without a server: its attacks come from the registry of
hostile_attacks.py (an attack added there is run with no change to the runner), and each phase's
goals (issue 42) are judged from the row."""

from __future__ import annotations

import importlib.util
import multiprocessing
import subprocess
import sys

import pytest
from repo_paths import ROOT

BENCH = ROOT / "benchmarks" / "serving"


@pytest.fixture
def hostile(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("hostile_client_under_test", BENCH / "hostile_client.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_help_runs_and_lists_every_registered_attack():
    done = subprocess.run([sys.executable, str(BENCH / "hostile_client.py"), "--list"], capture_output=True,
                          text=True, timeout=120, check=True)
    for name in ("oversize", "slowloris", "idle", "stops", "long-prompts", "cpu-burn", "slow-reader", "big-logprobs",
                 "big-tokenize"):
        assert name in done.stdout
    helped = subprocess.run([sys.executable, str(BENCH / "hostile_client.py"), "--help"], capture_output=True,
                            text=True, timeout=120, check=True)
    assert "--settle" in helped.stdout


def test_an_attack_added_to_the_registry_is_run_by_the_attacker_and_its_500s_counted(hostile):

    from hostile_attacks import REGISTRY, attack

    assert REGISTRY is hostile.REGISTRY

    @attack("test-only", "records a 500 and a 200")
    def test_only(run):
        run.record(500)
        run.record("chat 200")

    try:
        queue = multiprocessing.Queue()
        hostile.attack("test-only", "http://127.0.0.1:9", 0.1, 0.0, queue)
        assert queue.get(timeout=10) == {"500": 1, "chat 200": 1}
        assert hostile._fivehundreds({"500": 1, "chat 500": 2, "chat 200": 5}) == 3
    finally:
        REGISTRY.pop("test-only", None)


def test_goals_are_judged_per_phase(hostile):
    row = {"health_p99_ms": 20.0, "itl_p99_vs_quiet": 1.2, "rss_before_mib": 300.0, "rss_after_mib": 320.0,
           "tracebacks": 0, "answers_500": 0}
    assert hostile.goals_met(row)
    assert not hostile.goals_met({**row, "rss_after_mib": 340.0})  # +13 %
    assert not hostile.goals_met({**row, "health_p99_ms": 150.0})
    assert not hostile.goals_met({**row, "answers_500": 1})
