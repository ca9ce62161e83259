"""One-shot GPU suite: every backend's correctness tests, decode-attention timings, an end-to-end throughput
comparison with transformers, then the tables.

Usage on a CUDA machine, from the repository root (give the device tool ``timeout_s`` 420: the suite stops
itself before ``--budget`` seconds, 360 by default)::

    pip install --no-deps --no-build-isolation --no-index -e . -q; python benchmarks/gpu/gpu_suite.py --budget 360

(``;``, not ``&&``: if the install fails, the suite runs the checkout through a shim, see ``gpu/bootstrap.py``.)
Exactly three files go to ``$OUT`` (else ``./gpu_suite_out/``), rewritten after every phase so a kill at any
moment keeps what finished: ``gpu_suite.md`` (goals, tables; ready for ``benchmarks/RESULTS.md``),
``gpu_suite.json`` (everything, with per-point raw numbers and failing test names) and ``logs.tar.gz`` (every
pytest log, worker log and JUnit XML). The tables are printed last, the goals at the very end. Without CUDA
the script prints ``no CUDA device: nothing to run`` and exits 0; ``--dry-run`` runs the same code paths on
the CPU with tiny shapes (torch backend only, ``perf_counter`` instead of CUDA events) plus a self-check of
the test runner, in seconds (``tests/benchmarks/test_gpu_suite_dry_run.py`` runs it in ``make test``).

Phases (budget: the tests get ``--tests-share`` of it; what is left is divided among the remaining
benchmark workers by weight, recomputed as each one finishes, so time one does not use goes to the next):

1. Correctness, in parallel processes (``gpu/runner.py``): ``tests/backends/triton/test_triton_*.py``,
   ``tests/backends/cupy/test_cupy_gpu.py`` (big files in shards),
   ``tests/backends/torch_ref/test_reference_attention.py``,
   ``tests/core/model/test_generate_matches_hf.py -k "llama and 16"``, and a tiny random Llama generated greedily by the
   engine on ``cuda`` with each backend against transformers (``gpu/e2e.py``).
2. Decode attention (``gpu/kernels.py``), one process per backend: SDPA on contiguous K/V (default dispatch
   and flash-only), triton, cupy, torch; batch 64, context 2048, fp16 and bf16, SmolLM2 / Llama-3.2-1B /
   Llama-8B heads, shuffled block tables, L2 flushed between calls, CUDA-event medians; bandwidth against a
   1 GiB device copy; extra batch/context points if time allows.
3. End to end (``gpu/throughput.py``): a Llama-3.2-1B-shaped model with random bf16 weights, 64 ShareGPT-like
   requests; tokens/s of pagedkv per backend, transformers ``generate`` (padded) and ``generate_batch``
   (continuous batching); the tensor-parallel point skips until ``EngineConfig.tensor_parallel_size`` exists.

Goals reported (``gpu/report.py``): decode attention >= 80 % of copy bandwidth and <= 1.10x contiguous attention
at batch 64, context 2048; engine >= 2x ``generate_batch`` throughput. Exit status 0 whenever the suite ran.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the gpu package
# and this folder off the path (Python puts a script's own folder first): gpu/kernels.py would shadow the
# `kernels` package that transformers imports, and the other modules here are as generic in name
sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != Path(__file__).resolve().parent]

from gpu.bootstrap import bootstrap  # noqa: E402
from gpu.rows import read_rows  # noqa: E402
from gpu.runner import (  # noqa: E402
    REPO,
    SUITE,
    Runner,
    _child_env,
    _kill_group,
    _tail,
    dry_test_steps,
    gpu_test_steps,
    now,
    summarize_tests,
)

# share of the benchmark time per worker (the rest of the budget after the tests, split by these weights)
WEIGHTS = {"sdpa": 1.0, "triton": 1.2, "cupy": 1.2, "torch": 0.8, "e2e": 3.5}
RESERVE_S = 6.0  # kept at the end for the last report
PUBLISH_EVERY_S = 10.0  # how often rows of a running worker are written into the report


class Suite:
    """The state the report is written from, and the process running now (killed on SIGTERM)."""

    def __init__(self, args: argparse.Namespace, out_dir: Path, work_dir: Path) -> None:
        from gpu.throughput import ATTENTION_POINT

        self.args, self.out_dir, self.work_dir, self.t0 = args, out_dir, work_dir, now()
        self.deadline = self.t0 + args.budget
        self.active: subprocess.Popen | None = None
        self.active_rows: tuple[str, Path] | None = None
        self.worker_rows: dict[str, list[dict[str, Any]]] = {}  # what each benchmark worker has reported so far
        self.last_write = now()
        self.runner: Runner | None = None
        self.state: dict[str, Any] = {
            "dry_run": args.dry_run, "budget_s": args.budget, "wall_s": 0.0, "complete": False, "phase": "start",
            "tests": [], "workers": [], "rows": [], "e2e": [], "tp": [], "e2e_notes": [],
            "e2e_attention_point": ATTENTION_POINT["dry" if args.dry_run else "gpu"],
        }

    def write(self, phase: str, complete: bool = False) -> None:
        from gpu.output import write_outputs

        self.state.update(phase=phase, complete=complete, wall_s=now() - self.t0, rows=[], e2e=[], tp=[])
        for rows in self.worker_rows.values():
            for r in rows:
                kind = r.get("kind")
                if kind in ("e2e", "tp"):
                    self.state[kind].append(r)
                elif kind == "e2e_info":
                    self.state["e2e_notes"] = [_e2e_note(r)]
                else:
                    self.state["rows"].append(r)
        self.last_write = now()
        write_outputs(self.out_dir, self.work_dir, self.state)

    def kill_children(self) -> None:
        """Stop whatever runs now, keeping the rows the running worker had written."""
        if self.active is not None and self.active.poll() is None:
            _kill_group(self.active)
        if self.active_rows is not None:
            name, path = self.active_rows
            self.worker_rows[name] = read_rows(path)
        if self.runner is not None:
            self.runner.kill_all()
            self.state["tests"] = summarize_tests(self.runner.steps)


def run_tests(suite: Suite) -> None:
    args = suite.args
    suite.runner = runner = Runner(suite.work_dir / "logs")
    tests_deadline = now() + (20 if args.dry_run else args.tests_share * args.budget)
    if args.dry_run:
        dry_test_steps(suite.work_dir, runner)
    else:
        gpu_test_steps(suite.work_dir, runner, tests_deadline)
    def publish() -> None:
        suite.state["tests"] = summarize_tests(runner.steps)
        suite.write("tests running")

    runner.wait(tests_deadline, on_tick=publish, every=PUBLISH_EVERY_S)
    suite.state["tests"] = summarize_tests(runner.steps)
    suite.runner = None
    print(f"[tests] done at {now() - suite.t0:.0f}s", flush=True)
    for e in suite.state["tests"]:
        print(f"  {e['status']:<11} {e['step']}: {e['passed']} passed, {e['failed']} failed, {e['errors']} errors, "
              f"{e['skipped']} skipped ({e['seconds']:.0f}s)", flush=True)


def worker_argv(name: str, rows: Path, worker_deadline: float, args: argparse.Namespace) -> list[str]:
    argv = [sys.executable, str(SUITE), "--rows", str(rows), "--worker-deadline", str(worker_deadline)]
    if name == "e2e":
        argv += ["--e2e-worker", "--backends", ",".join(args.backends), "--e2e-requests", str(args.e2e_requests),
                 "--e2e-scale", str(args.e2e_scale)]
    else:
        argv += ["--worker", name] + ([] if args.extras else ["--no-extras"])
    return argv + (["--dry-run"] if args.dry_run else [])


def run_workers(suite: Suite, names: list[str]) -> None:
    """Each worker gets its weight's share of the time left (after the reserve) among the workers still to run."""
    state = suite.state
    for i, name in enumerate(names):
        left = suite.deadline - RESERVE_S - now()
        timeout = left * WEIGHTS[name] / sum(WEIGHTS[n] for n in names[i:])
        if timeout < (3 if suite.args.dry_run else 15):
            state["workers"].append({"worker": name, "status": f"not run: out of time ({timeout:.0f}s share)"})
            suite.write(f"{name} skipped")
            continue
        rows_path = suite.work_dir / "logs" / f"{name}_rows.jsonl"
        rows_path.unlink(missing_ok=True)
        grace = min(10.0, 0.15 * timeout)  # the worker stops starting new work this long before it is killed
        argv = worker_argv(name, rows_path, time.time() + timeout - grace, suite.args)
        started = now()
        with open(suite.work_dir / "logs" / f"{name}.log", "wb") as handle:
            suite.active = proc = subprocess.Popen(argv, cwd=REPO, env=_child_env(), stdout=handle,
                                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                   start_new_session=True)
            suite.active_rows = (name, rows_path)
            rc = _wait_publishing(suite, proc, rows_path, started + timeout, name)
        suite.active = suite.active_rows = None
        got = read_rows(rows_path)
        suite.worker_rows[name] = got
        fatal = [r["error"] for r in got if r.get("kind") == "fatal"]
        status = "ok" if rc == 0 else f"exit {rc}" + (f": {fatal[0]}" if fatal else "")
        if rc != 0 and not fatal:
            lines = [ln for ln in _tail(suite.work_dir / "logs" / f"{name}.log", 4000).splitlines() if ln.strip()]
            status += f": {lines[-1][:300]}" if lines else ""
        state["workers"].append({"worker": name, "status": status, "seconds": round(now() - started, 1),
                                 "share_s": round(timeout, 1), "rows": len(got)})
        print(f"[{name}] {status} ({now() - started:.0f}s of {timeout:.0f}s, {len(got)} rows)", flush=True)
        suite.write(f"after {name}")


def _wait_publishing(suite: Suite, proc: subprocess.Popen, rows_path: Path, until: float, name: str) -> int | str:
    """Wait for the worker; every few seconds, rows it has written since go into the report files, so a kill
    of this whole script loses at most those last seconds."""
    published = 0
    while proc.poll() is None:
        if now() > until:
            _kill_group(proc)
            return "killed at its time share"
        time.sleep(0.25)
        if now() - suite.last_write > PUBLISH_EVERY_S:
            rows = read_rows(rows_path)
            if len(rows) > published:
                published = len(rows)
                suite.worker_rows[name] = rows
                suite.write(f"{name} running")
            suite.last_write = now()
    return proc.returncode


def _e2e_note(info: dict[str, Any]) -> str:
    m = info["model"]
    return (f"Model: Llama, hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, {m['num_attention_heads']} "
            f"heads / {m['num_key_value_heads']} KV heads, vocab {m['vocab_size']}, random {info['dtype']} weights on "
            f"{info['device']}. Requests: {info['requests']} ShareGPT-like (scale {info['scale']}), "
            f"{info['prompt_tokens']} prompt / {info['output_tokens']} output tokens, longest prompt "
            f"{info['max_prompt']}, longest output {info['max_output']}; greedy, EOS ignored; tok/s = output tokens "
            f"of finished requests / wall time after a warm-up.")


def run_suite(args: argparse.Namespace) -> int:
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path.cwd() / "gpu_suite_out"
    out_dir.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="gpu_suite_work_"))
    (work_dir / "logs").mkdir()
    note = bootstrap(REPO)
    suite = Suite(args, out_dir, work_dir)
    print(f"gpu_suite: {'DRY RUN on CPU' if args.dry_run else 'GPU run'}, budget {args.budget:.0f}s; results in "
          f"{out_dir}; logs in {work_dir}" + (f"\n{note}" if note else ""), flush=True)

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    phase = "start"
    try:
        suite.write(phase)
        if not args.skip_tests:
            phase = "tests"
            run_tests(suite)
            suite.write("after tests")
        names = [] if args.skip_bench else [n for n in ("sdpa", "triton", "cupy", "torch") if n in args.backends]
        if args.dry_run:
            names = [n for n in names if n in ("sdpa", "torch")]
        names += [] if args.skip_e2e else ["e2e"]
        phase = "benchmarks"
        run_workers(suite, names)
        suite.write("done", complete=True)
    except (KeyboardInterrupt, SystemExit):
        suite.kill_children()
        suite.write(f"interrupted during {phase}")
        print(f"\ninterrupted during {phase}: partial results written", flush=True)
    from gpu.output import final_text

    print("\n" + final_text(suite.state, out_dir), flush=True)
    shutil.rmtree(work_dir, ignore_errors=True)  # everything in it is in logs.tar.gz
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, torch backend only")
    ap.add_argument("--budget", type=float, default=360.0, help="seconds for the whole suite (default 360)")
    ap.add_argument("--tests-share", type=float, default=0.33, help="share of the budget for the tests (0.33)")
    ap.add_argument("--backends", default="sdpa,triton,cupy,torch", help="backends to time (kernels and e2e)")
    ap.add_argument("--no-extras", dest="extras", action="store_false", help="time only the main kernel points")
    ap.add_argument("--e2e-requests", type=int, default=64, help="end-to-end requests (default 64)")
    ap.add_argument("--e2e-scale", type=float, default=0.4, help="ShareGPT lengths times this (default 0.4)")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-bench", action="store_true", help="skip the kernel timings")
    ap.add_argument("--skip-e2e", action="store_true", help="skip the end-to-end comparison")
    # internal: the worker processes
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--e2e-check", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--e2e-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--e2e-device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    ap.add_argument("--worker-deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    worker_deadline = args.worker_deadline or time.time() + 60

    if args.worker:
        from gpu.kernels import bench_worker

        return bench_worker(args.worker, Path(args.rows), worker_deadline, args.dry_run, args.extras)
    if args.e2e_check:
        from gpu.e2e import check_worker

        return check_worker(Path(args.rows), args.e2e_device, ["torch", "triton", "cupy"])
    if args.e2e_worker:
        from gpu.e2e import throughput_worker

        return throughput_worker(Path(args.rows), worker_deadline, args.dry_run, args.backends, args.e2e_requests,
                                 args.e2e_scale)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: nothing to run")
            return 0
    return run_suite(args)


if __name__ == "__main__":
    sys.exit(main())
