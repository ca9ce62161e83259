"""benchmarks/gpu/gpu_suite.py on the CPU: the dry run exercises the test runner, the kernel timings and the
end-to-end comparison with transformers through the same code paths as the GPU run, with tiny shapes."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch
from repo_paths import ROOT

BENCH = ROOT / "benchmarks"
SUITE = BENCH / "gpu" / "gpu_suite.py"
TOOL_OUTPUT_TAIL = 12_000  # the device tool returns only this many trailing characters of output


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("out")
    res = subprocess.run([sys.executable, str(SUITE), "--dry-run"], cwd=out, env={**os.environ, "OUT": str(out)},
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    return res, out


def test_out_holds_exactly_the_three_files_the_device_tool_brings_back(dry_run) -> None:
    _, out = dry_run
    assert sorted(p.name for p in out.iterdir()) == ["gpu_suite.json", "gpu_suite.md", "logs.tar.gz"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert any(n.startswith("junit/") and n.endswith(".xml") for n in names), names
    for log in ("logs/sdpa.log", "logs/torch.log", "logs/e2e.log", "logs/e2e_rows.jsonl"):
        assert log in names


def test_kernel_table_times_every_point_against_the_reference(dry_run) -> None:
    res, out = dry_run
    lines = res.stdout.splitlines()
    table = lines[lines.index(next(ln for ln in lines if ln.startswith("backend "))):]
    assert table[0].split()[:5] == ["backend", "shape", "dtype", "batch", "ctx"]
    body = [ln.split() for ln in table[2:] if ln.strip()][:6]
    assert {row[0] for row in body} == {"sdpa", "torch"}
    assert all(row[5] != "-" for row in body), table  # every point was timed
    report = json.loads((out / "gpu_suite.json").read_text())
    assert report["dry_run"] and report["complete"] and report["copy_gbps"] > 0
    points = report["points"]
    assert len(points) == 6 and all(p["ok"] for p in points), points  # torch and SDPA agree with fp32
    assert all(p["x_contig"] == pytest.approx(1.0) for p in points if p["backend"] == "sdpa")


def test_runner_self_check_counts_junit_and_killed_steps(dry_run) -> None:
    res, _ = dry_run
    assert "1 passed, 1 failed, 0 errors, 1 skipped" in res.stdout
    assert "TIMEOUT" in res.stdout and "test_b [still running" in res.stdout


def test_end_to_end_compares_the_engine_with_both_transformers_paths(dry_run) -> None:
    res, out = dry_run
    report = json.loads((out / "gpu_suite.json").read_text())
    systems = {r["system"]: r for r in report["e2e"]}
    assert set(systems) == {"pagedkv[torch]", "hf generate_batch", "hf generate (padded)"}
    for name, r in systems.items():
        assert r["complete"] and r["finished"] == r["requests"] == 6, (name, r)
        assert r["tok_s"] > 0 and "error" not in r
    # every system produced exactly the requested tokens (EOS ignored), so the throughputs compare the same work
    assert len({r["output_tokens"] for r in systems.values()}) == 1
    assert report["tp"] == [{"kind": "tp", "note": "skipped: N=all needs at least 2 GPUs, this machine has 0"}]
    md = (out / "gpu_suite.md").read_text()
    assert "## Goals" in md and "## End to end" in md and "| backend | shape |" in md and "Status: complete" in md


def test_goals_are_printed_last_and_the_summary_fits_the_tool_output(dry_run) -> None:
    res, _ = dry_run
    summary = res.stdout[res.stdout.index("workers: "):]
    assert len(summary) <= TOOL_OUTPUT_TAIL
    lines = res.stdout.strip().splitlines()
    tail = lines[max(i for i, ln in enumerate(lines) if ln.split()[:3] == ["goal", "backend", "measured"]):]
    assert len(tail) < 12, tail  # the goals table, a blank line and the status line: nothing after them
    assert any("engine throughput vs generate_batch" in ln and " torch " in ln for ln in tail)
    assert tail[-1].startswith("complete in ")


def test_sigterm_while_a_worker_runs_keeps_the_rows_it_wrote(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, str(SUITE), "--dry-run", "--skip-tests", "--skip-e2e", "--backends",
                             "torch"], cwd=tmp_path, env={**os.environ, "OUT": str(tmp_path)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = proc.stdout.readline()
        rows = Path(first.rsplit("logs in ", 1)[1].strip()) / "logs" / "torch_rows.jsonl"
        limit = time.monotonic() + 90
        while not (rows.exists() and rows.read_text().count("\n") >= 1) and time.monotonic() < limit:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # the worker has timed its first point and is on the next ones
        output, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, output
    assert "interrupted during benchmarks: partial results written" in output
    assert "PARTIAL" in (tmp_path / "gpu_suite.md").read_text()
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert report["complete"] is False
    assert any(p["backend"] == "torch" and "median_us" in p for p in report["points"]), report["points"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_suite.json", "gpu_suite.md", "logs.tar.gz"]
    assert not rows.parent.parent.exists()  # the work folder went into logs.tar.gz and was removed


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


def test_shim_makes_the_checkout_importable_with_its_entry_points_when_not_installed(tmp_path: Path) -> None:
    # python -S: no site-packages, so nothing is installed, as on a GPU image where `pip install -e .` failed
    repo = BENCH.parent
    code = (
        "import sys, json, importlib.metadata, importlib.util; sys.path.insert(0, sys.argv[1]);"
        "from gpu.bootstrap import bootstrap; from pathlib import Path;"
        "line = bootstrap(Path(sys.argv[2])); print(line is not None);"
        "print(importlib.util.find_spec('pagedkv.core').submodule_search_locations[0]);"
        "print(json.dumps([ep.name for ep in importlib.metadata.entry_points(group='pagedkv')]))"
    )
    res = subprocess.run([sys.executable, "-S", "-c", code, str(BENCH), str(repo)], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    used_shim, core_dir, names = res.stdout.splitlines()
    assert used_shim == "True"
    assert Path(core_dir).resolve() == (repo / "core").resolve()
    assert {"torch", "triton", "cupy", "prefix_cache", "telemetry"} <= set(json.loads(names))


def test_pyproject_license_is_the_table_form_older_setuptools_reads() -> None:
    # a bare SPDX string (license = "Apache-2.0") fails metadata generation on setuptools < 77 (checked on 68)
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((BENCH.parent / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "Apache-2.0"}
    assert "License :: OSI Approved :: Apache Software License" in project["classifiers"]


def test_a_full_gpu_sized_report_keeps_the_goals_within_the_tool_output(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCH))
    try:
        from gpu.kernels import plan_points
        from gpu.output import final_text, write_outputs
    finally:
        sys.path.remove(str(BENCH))
    rows: list[dict] = [{"kind": "env", "gpu": "H200"}, {"kind": "copy", "gbps": 4000.0}]
    for backend in ("sdpa", "sdpa_flash", "torch", "triton", "cupy"):
        for p in plan_points(dry_run=False, extras=True):
            rows.append({"kind": "point", "backend": backend, **p, "bytes": 10**9, "median_us": 400.0, "ok": True})
    failing = ["tests/test_x.py::test_" + "y" * 280 + " [failure]"] * 10
    tests = [{"step": f"step {i}", "status": "FAIL", "passed": 1, "failed": 10, "errors": 0, "skipped": 0,
              "processes": 1, "seconds": 5.0, "failing": failing} for i in range(13)]
    e2e = [{"kind": "e2e", "system": s, "requests": 64, "finished": 64, "output_tokens": 8000, "seconds": 4.0,
            "tok_s": t, "complete": True} for s, t in (("pagedkv[triton]", 5000.0), ("hf generate_batch", 2000.0),
                                                       ("hf generate (padded)", 1500.0))]
    state = {"dry_run": False, "budget_s": 360, "wall_s": 350.0, "complete": True, "phase": "done", "tests": tests,
             "workers": [], "rows": rows, "e2e": e2e, "tp": [], "e2e_notes": ["Model: ..."],
             "e2e_attention_point": ("llama1b", "bfloat16")}
    text = final_text(state, tmp_path)
    assert len(text) <= TOOL_OUTPUT_TAIL
    lines = text.splitlines()
    goals = lines[next(i for i, ln in enumerate(lines) if ln.startswith("goal ")):]
    verdicts = [ln.split()[-1] for ln in goals[2:] if ln.strip() and not ln.startswith("complete")]
    assert len(verdicts) == 2 * 3 * 1 + 1  # bandwidth and ratio for 3 paged backends at bf16, engine for triton
    assert any("vs generate_batch" in ln and "2.50x" in ln and ln.endswith("met") for ln in goals)
    assert lines[-1].startswith("complete in 350s")
    write_outputs(tmp_path, tmp_path, state)  # the markdown keeps every point, extras included
    md = (tmp_path / "gpu_suite.md").read_text()
    assert md.count("| llama8b |") == 5 * len(plan_points(dry_run=False, extras=True)) // 3
