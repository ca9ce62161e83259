"""benchmarks/gpu_suite.py on the CPU: the dry run exercises the test runner and the timing path end to end."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SUITE = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_suite.py"


def test_dry_run_exits_0_and_prints_the_table_last(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path)}
    res = subprocess.run([sys.executable, str(SUITE), "--dry-run"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.strip().splitlines()
    table = lines[lines.index(next(ln for ln in lines if ln.startswith("backend "))):]
    assert table[0].split()[:5] == ["backend", "shape", "dtype", "batch", "ctx"]
    body = [ln.split() for ln in table[2:]]
    assert {row[0] for row in body} == {"sdpa", "torch"}
    assert len(body) == 6 and all(row[5] != "-" for row in body), table  # every point was timed
    # the runner's self-check: counts from JUnit XML, and from the -v log of a step killed at its timeout
    assert "1 passed, 1 failed, 0 errors, 1 skipped" in res.stdout
    assert "TIMEOUT" in res.stdout and "test_b [still running" in res.stdout
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert report["dry_run"] and report["copy_gbps"] > 0
    points = report["points"]
    assert all(p["ok"] for p in points), points  # torch and SDPA agree with the fp32 reference
    assert all(p["x_sdpa"] == pytest.approx(1.0) for p in points if p["backend"] == "sdpa")
    assert "| backend | shape |" in (tmp_path / "gpu_suite.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine-without-CUDA path")
def test_without_cuda_it_says_so_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("gpu_suite_under_test", SUITE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    assert module.main([]) == 0
    assert capsys.readouterr().out.strip() == "no CUDA device: nothing to run"
