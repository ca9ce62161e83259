"""The correctness phase: pytest files (and the tiny end-to-end check) run side by side, each with a timeout.

Counts come from each step's JUnit XML, or from its ``pytest -v`` log when it was killed first.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu.rows import read_rows

REPO = Path(__file__).resolve().parent.parent.parent
SUITE = REPO / "benchmarks" / "gpu" / "gpu_suite.py"
LOG_TAIL = 60_000


def now() -> float:
    return time.monotonic()


@dataclass
class Step:
    name: str  # one line of the summary (shards of one file share it)
    argv: list[str]
    timeout: float
    junit: Path | None = None
    rows: Path | None = None  # the e2e step reports through a JSONL file instead of JUnit
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path = REPO
    # filled while running
    proc: subprocess.Popen | None = None
    log: Path | None = None
    started: float = 0.0
    rc: int | None = None
    timed_out: bool = False
    seconds: float = 0.0


def _child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # compiled Triton kernels on the GPU
    env.setdefault("OMP_NUM_THREADS", "1")  # many processes share the CPU cores
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


class Runner:
    """Runs steps side by side, each in its own process group, and kills whatever outlives its timeout."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.steps: list[Step] = []
        self._uid = 0

    def start(self, step: Step) -> None:
        self._uid += 1
        step.log = self.log_dir / f"{self._uid:02d}_{_slug(step.name)}.log"
        for stale in (step.junit, step.rows):  # left by an earlier run into the same folder
            if stale is not None:
                stale.unlink(missing_ok=True)
        handle = open(step.log, "wb")  # noqa: SIM115 - closed in _finish
        step.started = now()
        try:
            step.proc = subprocess.Popen(
                step.argv, cwd=step.cwd, env=_child_env(step.env), stdout=handle, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        except OSError as exc:
            handle.write(f"could not start: {exc}\n".encode())
            step.rc = -1
        handle.close()
        self.steps.append(step)

    def wait(self, deadline: float, on_tick: Any = None, every: float = 10.0) -> None:
        """Until every step ended or ``deadline``; ``on_tick()`` every ``every`` seconds meanwhile."""
        last = now()
        while True:
            running = [s for s in self.steps if s.proc is not None and s.rc is None and not s.timed_out]
            if not running:
                return
            for s in running:
                rc = s.proc.poll()
                if rc is not None:
                    s.rc, s.seconds = rc, now() - s.started
                elif now() - s.started > s.timeout or now() > deadline:
                    _kill_group(s.proc)
                    s.timed_out, s.seconds = True, now() - s.started
            time.sleep(0.2)
            if on_tick is not None and now() - last > every:
                on_tick()
                last = now()

    def kill_all(self) -> None:
        """Stop every step still running (the suite itself is being stopped); they count as timed out."""
        for s in self.steps:
            if s.proc is not None and s.rc is None and not s.timed_out:
                _kill_group(s.proc)
                s.timed_out, s.seconds = True, now() - s.started


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this script created for that one child
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:80]


def _tail(path: Path | None, limit: int = LOG_TAIL) -> str:
    if path is None or not path.exists():
        return ""
    data = path.read_bytes()
    return data[-limit:].decode("utf-8", "replace")


def _pytest_argv(args: list[str], junit: Path) -> list[str]:
    # -v: one line per test, so the log of a step killed at its timeout still shows what passed and what hung
    return [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--junitxml", str(junit), *args]


def collect_node_ids(files: list[str], timeout: float) -> dict[str, list[str]] | None:
    """Node ids per file, from one ``pytest --collect-only`` (None if it fails)."""
    try:
        res = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
            cwd=REPO, env=_child_env(), capture_output=True, text=True, timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return None
    if res.returncode not in (0, 5):
        return None
    ids: dict[str, list[str]] = {f: [] for f in files}
    for line in res.stdout.splitlines():
        path = line.split("::", 1)[0]
        if "::" in line and path in ids:
            ids[path].append(line.strip())
    return ids


def gpu_test_steps(work_dir: Path, runner: Runner, deadline: float) -> None:
    """Start every correctness step; the two big files are split into shards that run side by side."""
    junit_dir = work_dir / "junit"
    junit_dir.mkdir(parents=True, exist_ok=True)
    n = [0]

    def junit() -> Path:
        n[0] += 1
        return junit_dir / f"{n[0]:02d}.xml"

    step_timeout = max(10.0, deadline - now())
    sharded = {"tests/backends/triton/test_triton_attention.py": 4, "tests/backends/cupy/test_cupy_gpu.py": 4}
    triton_tests = REPO / "tests" / "backends" / "triton"
    triton_files = sorted(os.path.relpath(p, REPO) for p in glob.glob(str(triton_tests / "test_triton_*.py")))
    single = [f for f in triton_files if f not in sharded] + ["tests/backends/torch_ref/test_reference_attention.py"]
    for f in single:
        j = junit()
        runner.start(Step(Path(f).name, _pytest_argv([f], j), step_timeout, junit=j))
    j = junit()
    runner.start(Step("test_generate_matches_hf.py -k 'llama and 16'",
                      _pytest_argv(["tests/core/model/test_generate_matches_hf.py", "-k", "llama and 16"], j),
                      step_timeout, junit=j))
    rows = runner.log_dir / "e2e_check_rows.jsonl"
    runner.start(Step("e2e tiny llama on cuda (torch/triton/cupy)", [sys.executable, str(SUITE), "--e2e-check",
                                                                   "--rows", str(rows)], step_timeout, rows=rows))
    big = [f for f in sharded if (REPO / f).exists()]
    ids = collect_node_ids(big, timeout=min(90.0, max(5.0, deadline - now()))) if big else {}
    for f in big:
        node_ids = (ids or {}).get(f) or []
        if not node_ids:  # collection failed: run the file whole
            j = junit()
            runner.start(Step(Path(f).name, _pytest_argv([f], j), max(10.0, deadline - now()), junit=j))
            continue
        shards = min(sharded[f], len(node_ids))
        size = -(-len(node_ids) // shards)
        for k in range(shards):
            chunk = node_ids[k * size : (k + 1) * size]
            if chunk:
                j = junit()
                runner.start(Step(Path(f).name, _pytest_argv(chunk, j), max(10.0, deadline - now()), junit=j))


def dry_test_steps(work_dir: Path, runner: Runner) -> None:
    """CPU self-check of the runner: a generated test file (1 pass, 1 fail, 1 skip) and a step that times out."""
    tmp = work_dir / "selfcheck"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "pytest.ini").write_text("[pytest]\n")
    (tmp / "test_selfcheck.py").write_text(
        "import pytest\n\n"
        "def test_passes():\n    assert True\n\n"
        "def test_fails():\n    assert 1 == 2, 'deliberate failure of the dry-run self-check'\n\n"
        "def test_skips():\n    pytest.skip('deliberate skip')\n"
    )
    junit_dir = work_dir / "junit"
    junit_dir.mkdir(parents=True, exist_ok=True)
    j = junit_dir / "selfcheck.xml"
    runner.start(Step("selfcheck (expect 1 passed, 1 failed, 1 skipped)", _pytest_argv(["test_selfcheck.py"], j),
                      60, junit=j, cwd=tmp, env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}))
    hang = ("import time; print('test_fake.py::test_a PASSED'); print('test_fake.py::test_b ', end='', flush=True); "
            "time.sleep(60)")
    runner.start(Step("selfcheck timeout (expect TIMEOUT, 1 passed, test_b killed)", [sys.executable, "-c", hang], 2,
                      junit=junit_dir / "never_written.xml"))


def _count_junit(path: Path) -> dict[str, Any] | None:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for key in counts:
            counts[key] += int(s.get(key, 0) or 0)
    failed = []
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            node = case.find(tag)
            if node is not None:
                msg = (node.get("message") or "").strip().splitlines()
                name = f"{case.get('classname', '')}::{case.get('name', '')}"
                failed.append(f"{name} [{tag}] {msg[0][:200] if msg else ''}")
    return {
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": counts["failures"],
        "errors": counts["errors"],
        "skipped": counts["skipped"],
        "failing": failed,
    }


def _count_log(path: Path | None) -> dict[str, Any] | None:
    """Counts from a ``pytest -v`` log, for a step killed before it wrote its JUnit XML."""
    text = _tail(path, 10_000_000)
    if not text:
        return None
    res: dict[str, Any] = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failing": []}
    last = ""
    for line in text.splitlines():
        parts = line.split()
        if not parts or "::" not in parts[0]:
            continue
        last = parts[0]
        if len(parts) > 1 and parts[1] in ("PASSED", "XFAIL", "XPASS"):
            res["passed"] += 1
        elif len(parts) > 1 and parts[1] == "SKIPPED":
            res["skipped"] += 1
        elif len(parts) > 1 and parts[1] in ("FAILED", "ERROR"):
            res["failed" if parts[1] == "FAILED" else "errors"] += 1
            res["failing"].append(f"{parts[0]} [{parts[1].lower()}]")
        else:
            continue
        last = ""
    if last:
        res["failing"].append(f"{last} [still running when the step was killed]")
    return res


def _count_rows(path: Path) -> dict[str, Any] | None:
    rows = read_rows(path)
    if not rows:
        return None
    res: dict[str, Any] = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failing": []}
    for r in rows:
        status = r.get("status")
        if status == "pass":
            res["passed"] += 1
        elif status == "skip":
            res["skipped"] += 1
        else:
            res["errors" if status == "error" else "failed"] += 1
            res["failing"].append(f"{r.get('name')} [{status}] {str(r.get('detail', ''))[:300]}")
    return res


def summarize_tests(steps: list[Step]) -> list[dict[str, Any]]:
    """One entry per step name (shards merged)."""
    merged: dict[str, dict[str, Any]] = {}
    for s in steps:
        entry = merged.setdefault(s.name, {
            "step": s.name, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "processes": 0, "timed_out": 0,
            "crashed": 0, "running": 0, "seconds": 0.0, "failing": [], "logs": [],
        })
        running = s.proc is not None and s.rc is None and not s.timed_out
        entry["processes"] += 1
        entry["seconds"] = max(entry["seconds"], round(now() - s.started if running else s.seconds, 1))
        entry["logs"].append(s.log.name if s.log else "")
        counts = None
        if s.junit is not None:
            counts = None if s.timed_out else _count_junit(s.junit)
            if counts is None:
                counts = _count_log(s.log)
        elif s.rows is not None:
            counts = _count_rows(s.rows)
        if counts:
            for key in ("passed", "failed", "errors", "skipped"):
                entry[key] += counts[key]
            entry["failing"].extend(counts["failing"])
        if s.timed_out:
            entry["timed_out"] += 1
        elif running:
            entry["running"] += 1
        elif s.rc not in (0, 1, 5) or (counts is None and s.rc != 0):  # 1: tests failed, 5: none collected
            entry["crashed"] += 1
            lines = [ln for ln in _tail(s.log, 4000).splitlines() if ln.strip()]
            entry["failing"].append(f"exit {s.rc}: {lines[-1][:300] if lines else 'no output'}")
    for entry in merged.values():
        if entry["timed_out"]:
            entry["status"] = "TIMEOUT"
        elif entry["running"]:
            entry["status"] = "RUNNING"
        elif entry["failed"] or entry["errors"] or entry["crashed"]:
            entry["status"] = "FAIL"
        elif entry["passed"]:
            entry["status"] = "ok"
        else:
            entry["status"] = "nothing ran"
    return list(merged.values())


