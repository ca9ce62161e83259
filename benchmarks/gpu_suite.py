"""One-shot GPU suite: every backend's correctness tests, then decode-attention timings, then a table.

Usage on a CUDA machine, from the repository root (the whole run is meant to take 2-3 minutes on an
H200 and stops itself before ``--budget`` seconds, 270 by default; give the device tool ``timeout_s`` ~420)::

    pip install --no-deps --no-build-isolation --no-index -e . -q && python benchmarks/gpu_suite.py

Results go to ``$OUT`` when that variable is set (the device tool brings back what is written there),
else to ``./gpu_suite_out/``: ``gpu_suite.md`` (ready to paste into ``benchmarks/RESULTS.md``),
``gpu_suite.json`` (everything, including per-point raw numbers and failing test names) and
``logs/`` (the tail of every pytest run and worker). On a machine without CUDA the script prints
``no CUDA device: nothing to run`` and exits 0. ``--dry-run`` runs the whole timing path on the CPU
with tiny shapes (torch backend and SDPA baseline only, ``perf_counter`` instead of CUDA events) plus a
self-check of the test runner, so the plumbing can be checked without a GPU.

What it does
------------
1. Correctness (in parallel, one process per step, each with a timeout; ``TRITON_INTERPRET`` unset):
   ``tests/test_triton_*.py``, ``tests/test_cupy_gpu.py`` (both big files split into shards run side by
   side), ``tests/test_reference_attention.py``, ``tests/test_generate_matches_hf.py -k "llama and 16"``
   (that file runs on the CPU), and an end-to-end check on ``cuda``: a tiny random Llama generated
   greedily by the engine on each backend (torch, triton, cupy), fp32, against transformers' ``generate``.
   Pass/fail/skip counts come from pytest's JUnit XML.
2. Decode attention timings, each backend in its own process (a crash or a lost CUDA context in one
   cannot take the others down): the SDPA baseline (``scaled_dot_product_attention`` with
   ``enable_gqa`` on the same K/V laid out contiguously as ``[B, Hkv, L, D]``), then triton, cupy and
   the torch reference. Main points: batch 64, context 2048, fp16 and bf16, SmolLM2-like heads
   (9 q / 3 kv, head_dim 64) and Llama-8B-like heads (32 / 8, 128), block size 16, shuffled block
   tables. Extra points (fp16): batch 1/16/256 at 2048, context 512/8192 at batch 64, batch 1 at 8192.
   Every point is first checked against an fp32 SDPA of the same data (``max err``), then timed with
   CUDA events around each call, after warm-up, with a 256 MiB write between calls to flush L2;
   the table shows the median. ``loop_us`` in the JSON is the mean of back-to-back calls
   (launch overhead included, no flush).
3. Bandwidth: bytes moved = K and V rows of every sequence + q + out. The reference is
   ``dst.copy_(src)`` of a 1 GiB buffer, counted as read + write (2 GiB per copy).

The table (printed last) has: backend, shape, dtype, batch, context, time (µs), GB/s, % of copy
bandwidth, time / SDPA time, max error against fp32, and for the main points whether the project goal
(>= 80 % of copy bandwidth and <= 1.10x SDPA) is met. The exit status is 0 whenever the suite itself
ran; failures are reported in the output, not in the exit status.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
REPO = SCRIPT.parent.parent
BLOCK_SIZE = 16
GPU_SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}
DRY_SHAPES = {"tiny": (4, 2, 16)}
MAIN_POINT = (64, 2048)
EXTRA_POINTS = [(1, 2048), (16, 2048), (256, 2048), (64, 512), (64, 8192), (1, 8192)]
BENCH_ORDER = ("sdpa", "triton", "cupy", "torch")
# max |out - fp32 SDPA| accepted at a timing point (a sanity check; the test files hold the real tolerances)
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 6e-2}
REF_SEQS = 8  # sequences of each timing point checked against fp32
COPY_BYTES = 1 << 30
FLUSH_BYTES = 256 << 20
GOAL_PCT, GOAL_RATIO = 80.0, 1.10
LOG_TAIL = 60_000


def now() -> float:
    return time.monotonic()


# ============================================================================ test phase


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

    def wait(self, deadline: float) -> None:
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


def gpu_test_steps(out_dir: Path, runner: Runner, deadline: float) -> None:
    """Start every correctness step; the two big files are split into shards that run side by side."""
    junit_dir = out_dir / "junit"
    junit_dir.mkdir(parents=True, exist_ok=True)
    n = [0]

    def junit() -> Path:
        n[0] += 1
        return junit_dir / f"{n[0]:02d}.xml"

    step_timeout = max(10.0, deadline - now())
    sharded = {"tests/test_triton_attention.py": 4, "tests/test_cupy_gpu.py": 4}
    triton_files = sorted(os.path.relpath(p, REPO) for p in glob.glob(str(REPO / "tests" / "test_triton_*.py")))
    single = [f for f in triton_files if f not in sharded] + ["tests/test_reference_attention.py"]
    for f in single:
        j = junit()
        runner.start(Step(Path(f).name, _pytest_argv([f], j), step_timeout, junit=j))
    j = junit()
    runner.start(Step("test_generate_matches_hf.py -k 'llama and 16'",
                      _pytest_argv(["tests/test_generate_matches_hf.py", "-k", "llama and 16"], j), step_timeout,
                      junit=j))
    rows = out_dir / "logs" / "e2e_rows.jsonl"
    runner.start(Step("e2e tiny llama on cuda (torch/triton/cupy)", [sys.executable, str(SCRIPT), "--e2e",
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


def dry_test_steps(out_dir: Path, runner: Runner) -> None:
    """CPU self-check of the runner: a generated test file (1 pass, 1 fail, 1 skip) and a step that times out."""
    tmp = Path(tempfile.mkdtemp(prefix="gpu_suite_selfcheck_"))
    (tmp / "pytest.ini").write_text("[pytest]\n")
    (tmp / "test_selfcheck.py").write_text(
        "import pytest\n\n"
        "def test_passes():\n    assert True\n\n"
        "def test_fails():\n    assert 1 == 2, 'deliberate failure of the dry-run self-check'\n\n"
        "def test_skips():\n    pytest.skip('deliberate skip')\n"
    )
    junit_dir = out_dir / "junit"
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
    rows = _read_rows(path)
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
            "crashed": 0, "seconds": 0.0, "failing": [], "logs": [],
        })
        entry["processes"] += 1
        entry["seconds"] = max(entry["seconds"], round(s.seconds, 1))
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
        elif s.rc not in (0, 1, 5) or (counts is None and s.rc != 0):  # 1: tests failed, 5: none collected
            entry["crashed"] += 1
            lines = [ln for ln in _tail(s.log, 4000).splitlines() if ln.strip()]
            entry["failing"].append(f"exit {s.rc}: {lines[-1][:300] if lines else 'no output'}")
    for entry in merged.values():
        if entry["timed_out"]:
            entry["status"] = "TIMEOUT"
        elif entry["failed"] or entry["errors"] or entry["crashed"]:
            entry["status"] = "FAIL"
        elif entry["passed"]:
            entry["status"] = "ok"
        else:
            entry["status"] = "nothing ran"
    return list(merged.values())


# ============================================================================ e2e worker (a process of its own)


def e2e_worker(rows: Path, device: str, backends: list[str]) -> int:
    """Tiny random Llama, fp32: the engine's greedy tokens on ``device`` for each backend vs transformers."""
    import copy

    sys.path.insert(0, str(REPO / "tests"))
    from conftest import _tiny_llama, hf_greedy, random_prompts
    from pagedkv import LLM, SamplingParams

    prompts = random_prompts([3, 17, 40, 1, 64, 9], seed=1)
    model = _tiny_llama()
    want = [hf_greedy(model, p, 16) for p in prompts]
    for backend in backends:
        name = f"e2e[{backend}-{device}]"
        try:
            llm = LLM(hf_model=copy.deepcopy(model), device=device, backend=backend, dtype="float32", block_size=16,
                      num_blocks=256)
            got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))]
            if got == want:
                _emit(rows, {"name": name, "status": "pass"})
            else:
                bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
                _emit(rows, {"name": name, "status": "fail", "detail": f"tokens differ for prompts {bad}"})
        except Exception as exc:  # noqa: BLE001 - every backend is checked even if one cannot run
            _emit(rows, {"name": name, "status": "error", "detail": f"{type(exc).__name__}: {exc}"[:500]})
            traceback.print_exc()
    return 0


# ============================================================================ benchmark worker (a process of its own)


def _emit(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut short by a kill
    return rows


def plan_points(dry_run: bool, extras: bool) -> list[dict[str, Any]]:
    points = []
    if dry_run:
        main_dtypes, shapes = ("float32", "bfloat16"), DRY_SHAPES
        main, extra = [(2, 64)], [(3, 40)]
    else:
        main_dtypes, shapes = ("float16", "bfloat16"), GPU_SHAPES
        main, extra = [MAIN_POINT], EXTRA_POINTS
    for dtype in main_dtypes:
        for shape, (h, hkv, d) in shapes.items():
            for b, ctx in main:
                points.append(dict(shape=shape, heads=h, kv_heads=hkv, head_dim=d, dtype=dtype, batch=b, context=ctx,
                                   main=True))
    if extras:
        for b, ctx in extra:
            for shape, (h, hkv, d) in shapes.items():
                points.append(dict(shape=shape, heads=h, kv_heads=hkv, head_dim=d, dtype=main_dtypes[0], batch=b,
                                   context=ctx, main=False))
    return points


def point_bytes(p: dict[str, Any]) -> int:
    es = 4 if p["dtype"] == "float32" else 2
    kv = 2 * p["batch"] * p["context"] * p["kv_heads"] * p["head_dim"] * es
    qo = 2 * p["batch"] * p["heads"] * p["head_dim"] * es
    return kv + qo


class Timer:
    """Per-call times in µs: CUDA events on a GPU, perf_counter (after a sync) on the CPU."""

    def __init__(self, torch: Any, device: Any, flush_bytes: int) -> None:
        self.torch = torch
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(flush_bytes, dtype=torch.uint8, device=device) if flush_bytes else None

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def per_call(self, fn: Any, reps: int, flush: bool = True) -> list[float]:
        flush = flush and self.flush is not None
        if self.cuda:
            ev = [(self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True))
                  for _ in range(reps)]
            for start, end in ev:
                if flush:
                    self.flush.zero_()
                start.record()
                fn()
                end.record()
            self.sync()
            return [start.elapsed_time(end) * 1e3 for start, end in ev]
        out = []
        for _ in range(reps):
            if flush:
                self.flush.zero_()
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
        return out

    def loop(self, fn: Any, reps: int) -> float:
        """Mean µs of ``reps`` back-to-back calls (no flush: launch overhead shows when kernels are short)."""
        self.sync()
        if self.cuda:
            start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            self.sync()
            return start.elapsed_time(end) * 1e3 / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e6 / reps


def measure(timer: Timer, fn: Any, budget_s: float, min_reps: int, max_reps: int, flush: bool = True) -> dict:
    for _ in range(3):
        fn()
    timer.sync()
    probe = statistics.median(timer.per_call(fn, 3, flush))
    reps = int(min(max_reps, max(min_reps, budget_s * 1e6 / max(probe, 1.0))))
    samples = timer.per_call(fn, reps, flush)
    return {
        "median_us": statistics.median(samples),
        "min_us": min(samples),
        "max_us": max(samples),
        "loop_us": timer.loop(fn, reps),
        "reps": reps,
    }


def make_backend(name: str, device: Any, dtype: Any) -> Any:
    from types import SimpleNamespace

    config = SimpleNamespace(device=str(device), dtype=dtype, block_size=BLOCK_SIZE)
    if name == "torch":
        from pagedkv.backends.torch_ref import TorchBackend

        return TorchBackend(device)
    if name == "triton":
        from pagedkv.backends.triton.backend import TritonBackend

        return TritonBackend(config)
    if name == "cupy":
        from pagedkv.backends.cupy.backend import CupyBackend

        return CupyBackend(config)
    raise ValueError(f"unknown backend {name!r}")


def build_case(torch: Any, p: dict[str, Any], device: Any, seed: int = 1234) -> dict[str, Any]:
    """The same data in every worker: a shuffled paged cache and its contiguous copy for the baseline."""
    from pagedkv.core.attention_metadata import AttentionMetadata

    dtype = getattr(torch, p["dtype"])
    b, ctx, h, hkv, d = p["batch"], p["context"], p["heads"], p["kv_heads"], p["head_dim"]
    per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = b * per_seq + 1
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    tables = perm[: b * per_seq].view(b, per_seq)
    gen = torch.Generator(device=device).manual_seed(seed)
    k_cache = torch.randn((num_blocks, BLOCK_SIZE, hkv, d), generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn((num_blocks, BLOCK_SIZE, hkv, d), generator=gen, device=device, dtype=dtype)
    query = torch.randn((b, h, d), generator=gen, device=device, dtype=dtype)
    meta = AttentionMetadata.build(block_tables=tables.tolist(), context_lens=[ctx - 1] * b, query_lens=[1] * b,
                                   block_size=BLOCK_SIZE, device=device)
    return {"tables": tables.to(device), "k_cache": k_cache, "v_cache": v_cache, "query": query, "meta": meta,
            "scale": d ** -0.5}


def contiguous_kv(case: dict[str, Any], p: dict[str, Any], seqs: int | None = None) -> tuple[Any, Any]:
    """``[B, Hkv, L, D]`` contiguous K and V of each sequence (of the first ``seqs`` ones)."""
    ctx = p["context"]
    tables = case["tables"][:seqs].long()

    def lay(cache: Any) -> Any:
        rows = cache[tables].reshape(tables.shape[0], -1, p["kv_heads"], p["head_dim"])[:, :ctx]
        return rows.permute(0, 2, 1, 3).contiguous()

    return lay(case["k_cache"]), lay(case["v_cache"])


def sdpa_decode(torch: Any, q: Any, k: Any, v: Any, scale: float) -> Any:
    out = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)
    return out.squeeze(2)


def env_info(torch: Any, device: Any) -> dict[str, Any]:
    info: dict[str, Any] = {"kind": "env", "python": platform.python_version(), "torch": torch.__version__,
                            "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda, l2_mib=round(getattr(props, "L2_cache_size", 0) / 2**20, 1))
    for mod in ("triton", "cupy", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a missing optional package is just noted
            info[mod] = None
    return info


def bench_worker(name: str, rows: Path, deadline: float, dry_run: bool, extras: bool) -> int:
    import torch

    device = torch.device("cpu" if dry_run else "cuda")
    timer = Timer(torch, device, 0 if dry_run else FLUSH_BYTES)
    if name == "sdpa":
        _emit(rows, env_info(torch, device))
        nbytes = (16 << 20) if dry_run else COPY_BYTES
        src = torch.ones(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        m = measure(timer, lambda: dst.copy_(src), 0.3, 10, 100, flush=False)
        _emit(rows, {"kind": "copy", "bytes": nbytes, **m, "gbps": 2 * nbytes / m["median_us"] / 1e3})
        del src, dst
    backends: dict[str, Any] = {}
    for p in plan_points(dry_run, extras):
        key = {k: p[k] for k in ("shape", "heads", "kv_heads", "head_dim", "dtype", "batch", "context", "main")}
        row: dict[str, Any] = {"kind": "point", "backend": name, **key, "bytes": point_bytes(p)}
        if time.time() > deadline:
            _emit(rows, {**row, "error": "skipped: the worker ran out of time"})
            continue
        try:
            case = build_case(torch, p, device)
            q, scale = case["query"], case["scale"]
            # fp32 reference on the first few sequences only: an fp32 GQA SDPA of a whole big point would take
            # the math path, which expands K/V per query head (tens of GB at batch 256, context 8k)
            kc, vc = contiguous_kv(case, p, REF_SEQS)
            ref = sdpa_decode(torch, q[:REF_SEQS].float(), kc.float(), vc.float(), scale)
            kc = vc = None
            if name == "sdpa":
                kc, vc = contiguous_kv(case, p)

                def fn(q=q, kc=kc, vc=vc, scale=scale):  # noqa: ANN001, ANN202
                    return sdpa_decode(torch, q, kc, vc, scale)
            else:
                if p["dtype"] not in backends:
                    try:
                        backends[p["dtype"]] = make_backend(name, device, getattr(torch, p["dtype"]))
                    except Exception as exc:  # noqa: BLE001 - recorded, and the next dtype is tried
                        backends[p["dtype"]] = exc
                backend = backends[p["dtype"]]
                if isinstance(backend, Exception):
                    raise RuntimeError(f"backend construction failed: {type(backend).__name__}: {backend}")

                def fn(backend=backend, case=case):  # noqa: ANN001, ANN202
                    return backend.attend(case["query"], case["k_cache"], case["v_cache"], case["meta"],
                                          case["scale"])
            out = fn()[:REF_SEQS]
            timer.sync()
            row["max_err"] = float((out.float() - ref).abs().max().item()) if out.shape == ref.shape else float("nan")
            row["tol"] = TOLERANCE[p["dtype"]]
            finite = out.shape == ref.shape and bool(torch.isfinite(out).all().item())
            row["ok"] = bool(finite and row["max_err"] <= row["tol"])
            del out, ref
            budget, lo, hi = (0.4, 10, 200) if p["main"] else (0.15, 5, 100)
            row.update(measure(timer, fn, budget, lo, hi))
            _emit(rows, row)
        except Exception as exc:  # noqa: BLE001 - recorded; the next point runs if the device still works
            _emit(rows, {**row, "error": f"{type(exc).__name__}: {exc}"[:500]})
            traceback.print_exc()
            if device.type == "cuda":
                try:
                    torch.cuda.synchronize()
                except Exception as fatal:  # noqa: BLE001
                    _emit(rows, {"kind": "fatal", "backend": name, "error": f"CUDA context lost: {fatal}"[:500]})
                    return 3
        finally:
            case = kc = vc = q = ref = out = fn = None  # noqa: F841 - free the point's tensors before the next
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 0


# ============================================================================ report


def combine(rows: list[dict[str, Any]]) -> tuple[dict[str, Any], float | None, list[dict[str, Any]]]:
    env = next((r for r in rows if r.get("kind") == "env"), {})
    copy_row = next((r for r in rows if r.get("kind") == "copy"), None)
    copy_gbps = copy_row["gbps"] if copy_row else None
    points = [r for r in rows if r.get("kind") == "point"]

    def key(r: dict[str, Any]) -> tuple:
        return (r["shape"], r["dtype"], r["batch"], r["context"])

    base = {key(r): r["median_us"] for r in points if r["backend"] == "sdpa" and "median_us" in r}
    for r in points:
        if "median_us" not in r:
            continue
        r["gbps"] = r["bytes"] / r["median_us"] / 1e3
        r["pct_copy"] = 100 * r["gbps"] / copy_gbps if copy_gbps else None
        r["x_sdpa"] = r["median_us"] / base[key(r)] if key(r) in base else None
        if r["main"] and r["backend"] != "sdpa":
            r["goal"] = bool(r["pct_copy"] is not None and r["x_sdpa"] is not None and r["pct_copy"] >= GOAL_PCT
                             and r["x_sdpa"] <= GOAL_RATIO and r.get("ok"))
    order = {b: i for i, b in enumerate(("sdpa", "torch", "triton", "cupy"))}
    points.sort(key=lambda r: (not r["main"], r["shape"], r["dtype"], r["batch"], r["context"],
                               order.get(r["backend"], 9)))
    return env, copy_gbps, points


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def bench_table(points: list[dict[str, Any]]) -> list[list[str]]:
    head = ["backend", "shape", "dtype", "batch", "ctx", "time us", "GB/s", "% copy", "x SDPA", "max err", "goal/note"]
    lines = [head]
    for r in points:
        if "median_us" in r:
            note = "" if r.get("ok", True) else "WRONG RESULT"
            if "goal" in r:
                note = ("goal met" if r["goal"] else "goal missed") + (f"; {note}" if note else "")
            cells = [_fmt(r["median_us"], ".1f"), _fmt(r["gbps"], ".0f"), _fmt(r["pct_copy"], ".1f"),
                     _fmt(r["x_sdpa"], ".2f"), _fmt(r.get("max_err"), ".1e"), note]
        else:
            cells = ["-", "-", "-", "-", "-", str(r.get("error", "no result"))[:70]]
        lines.append([r["backend"], r["shape"], r["dtype"], str(r["batch"]), str(r["context"]), *cells])
    return lines


def tests_table(summary: list[dict[str, Any]]) -> list[list[str]]:
    lines = [["step", "status", "passed", "failed", "errors", "skipped", "procs", "s"]]
    for e in summary:
        lines.append([e["step"], e["status"], str(e["passed"]), str(e["failed"]), str(e["errors"]), str(e["skipped"]),
                      str(e["processes"]), f"{e['seconds']:.0f}"])
    return lines


def render_text(lines: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    out = []
    for n, row in enumerate(lines):
        out.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def render_md(lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(lines[0]) + " |", "|" + "---|" * len(lines[0])]
    out += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in lines[1:]]
    return "\n".join(out)


# ============================================================================ main


def run_suite(args: argparse.Namespace) -> int:
    t0 = now()
    deadline = t0 + args.budget
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path.cwd() / "gpu_suite_out"
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"gpu_suite: {'DRY RUN on CPU' if args.dry_run else 'GPU run'}; results in {out_dir}", flush=True)

    # ---- 1. correctness
    test_summary: list[dict[str, Any]] = []
    if not args.skip_tests:
        runner = Runner(log_dir)
        tests_deadline = now() + (20 if args.dry_run else args.tests_share * args.budget)
        if args.dry_run:
            dry_test_steps(out_dir, runner)
        else:
            gpu_test_steps(out_dir, runner, tests_deadline)
        runner.wait(tests_deadline)
        test_summary = summarize_tests(runner.steps)
        print(f"\n[tests] {now() - t0:.0f}s", flush=True)
        for e in test_summary:
            print(f"  {e['status']:<11} {e['step']}: {e['passed']} passed, {e['failed']} failed, {e['errors']} errors, "
                  f"{e['skipped']} skipped ({e['seconds']:.0f}s)", flush=True)
            for line in e["failing"][:8]:
                print(f"      {line}", flush=True)
            if len(e["failing"]) > 8:
                print(f"      ... {len(e['failing']) - 8} more in gpu_suite.json", flush=True)

    # ---- 2./3. timings
    rows: list[dict[str, Any]] = []
    workers: list[dict[str, Any]] = []
    if not args.skip_bench:
        wanted = ["sdpa", "torch"] if args.dry_run else [b for b in BENCH_ORDER if b in args.backends]
        per_worker = {"sdpa": 45, "triton": 60, "cupy": 60, "torch": 45}
        for name in wanted:
            left = deadline - now() - 5
            if left < 10:
                workers.append({"worker": name, "status": "not run: out of time"})
                continue
            timeout = min(per_worker[name] * (2 if args.dry_run else 1), left)
            rows_path = log_dir / f"bench_{name}.jsonl"
            rows_path.unlink(missing_ok=True)
            log = log_dir / f"bench_{name}.log"
            argv = [sys.executable, str(SCRIPT), "--worker", name, "--rows", str(rows_path),
                    "--worker-deadline", str(time.time() + timeout - 8)]
            argv += ["--dry-run"] if args.dry_run else []
            argv += [] if args.extras else ["--no-extras"]
            started = now()
            with open(log, "wb") as handle:
                proc = subprocess.Popen(argv, cwd=REPO, env=_child_env(), stdout=handle, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
                try:
                    rc: int | str = proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    _kill_group(proc)
                    rc = "timeout"
            got = _read_rows(rows_path)
            rows.extend(got)
            fatal = [r["error"] for r in got if r.get("kind") == "fatal"]
            status = "ok" if rc == 0 else f"exit {rc}" + (f": {fatal[0]}" if fatal else "")
            if rc not in (0, "timeout") and not fatal:
                lines = [ln for ln in _tail(log, 4000).splitlines() if ln.strip()]
                status += f": {lines[-1][:300]}" if lines else ""
            workers.append({"worker": name, "status": status, "seconds": round(now() - started, 1),
                            "points": sum(1 for r in got if r.get("kind") == "point")})
            print(f"[bench] {name}: {status} ({now() - started:.0f}s, "
                  f"{sum(1 for r in got if r.get('kind') == 'point' and 'median_us' in r)} points timed)", flush=True)

    env, copy_gbps, points = combine(rows)
    table = bench_table(points)
    ttable = tests_table(test_summary) if test_summary else None
    header = (f"gpu: {env.get('gpu', env.get('device', '?'))}; torch {env.get('torch')}, triton {env.get('triton')}, "
              f"cupy {env.get('cupy')}; copy bandwidth (read+write) {_fmt(copy_gbps, '.0f')} GB/s; "
              f"block size {BLOCK_SIZE}; median of CUDA-event times per call with L2 flushed"
              + (" [DRY RUN: CPU, perf_counter, tiny shapes]" if args.dry_run else ""))
    total = now() - t0

    md = [f"# gpu_suite results ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "", header, ""]
    if ttable:
        md += ["## Correctness", "", render_md(ttable), ""]
        for e in test_summary:
            md += [f"- {e['step']}: {line}" for line in e["failing"][:20]]
        md += [""]
    md += ["## Decode attention", "", render_md(table), "",
           f"Goal: >= {GOAL_PCT:.0f}% of copy bandwidth and <= {GOAL_RATIO:.2f}x SDPA at batch 64, context 2048.",
           "", f"Workers: {json.dumps(workers)}", "", f"Suite wall time: {total:.0f}s", ""]
    (out_dir / "gpu_suite.md").write_text("\n".join(md))
    (out_dir / "gpu_suite.json").write_text(json.dumps(
        {"env": env, "copy_gbps": copy_gbps, "tests": test_summary, "workers": workers, "points": points,
         "wall_s": round(total, 1), "dry_run": args.dry_run}, indent=1, default=str))

    print(f"\n{header}", flush=True)
    if ttable:
        print("\n" + render_text(ttable))
    print(f"\nsuite wall time {total:.0f}s; written: {out_dir / 'gpu_suite.md'}, {out_dir / 'gpu_suite.json'}\n")
    print(render_text(table), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, torch backend and SDPA only")
    ap.add_argument("--budget", type=float, default=270.0, help="seconds for the whole suite (default 270)")
    ap.add_argument("--tests-share", type=float, default=0.45, help="share of the budget for the tests (0.45)")
    ap.add_argument("--backends", default="sdpa,triton,cupy,torch", help="benchmark workers to run")
    ap.add_argument("--no-extras", dest="extras", action="store_false", help="time only the main points")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    # internal: the worker processes
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--e2e", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--e2e-device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--e2e-backends", default="torch,triton,cupy", help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    ap.add_argument("--worker-deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]

    if args.worker:
        return bench_worker(args.worker, Path(args.rows), args.worker_deadline or time.time() + 60, args.dry_run,
                            args.extras)
    if args.e2e:
        return e2e_worker(Path(args.rows), args.e2e_device, args.e2e_backends.split(","))
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: nothing to run")
            return 0
    return run_suite(args)


if __name__ == "__main__":
    sys.exit(main())
