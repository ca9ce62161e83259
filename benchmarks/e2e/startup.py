"""Start-up time of `engine run --prompt hi --max-tokens 1` and `engine serve` (issue 26), phase by phase.

Each round runs, in fresh processes, ``engine --log-level debug run --prompt hi --max-tokens 1 --json``
(wall time to exit; "first token at" is the time since the process started at which the first step
ended) and ``engine serve --log-level debug --port P`` (wall time from spawn until ``GET /health``
answers 200; then SIGINT). The phase lines are those ``pagedkv.core.startup_phases`` logs. The first
round of a session may be cold (the page cache, the CPU kernel's cached build); read warm figures
from the later rounds. ``--fresh-cache`` points ``PAGEDKV_CACHE`` at an empty directory for the first
round, so it pays the one-time conversions (GGUF to safetensors, kernel build) as a new user does.
``--compare DIR`` runs a second source tree of pagedkv (e.g. ``git archive COMMIT | tar -x -C DIR``)
in the same rounds, alternating with this one, through ``PYTHONPATH`` with this venv's packages: a
before/after in one session, under the same load. CPU time is the child's user + sys.

    python benchmarks/e2e/startup.py --rounds 3
    python benchmarks/e2e/startup.py --rounds 3 --compare /tmp/pagedkv-before
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ENGINE = [str(Path(sys.executable).with_name("engine"))]
PHASE = re.compile(r"^pagedkv\.startup: DEBUG: (?P<name>.+?)(?: (?P<took>[\d.]+) s)? \(at (?P<at>[\d.]+) s\)$")


def phases(stderr: str) -> list[tuple[str, float | None, float]]:
    """(name, seconds or None, seconds since the process started) per phase line."""
    found = []
    for line in stderr.splitlines():
        m = PHASE.match(line.strip())
        if m:
            found.append((m["name"], float(m["took"]) if m["took"] else None, float(m["at"])))
    return found


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(engine: list[str], env: dict[str, str]) -> tuple[float, float, list]:
    """(wall s, CPU s, phases) of one ``engine run --prompt hi --max-tokens 1``."""
    cpu, started = _children_cpu(), time.perf_counter()
    proc = subprocess.run([*engine, "--log-level", "debug", "run", "--prompt", "hi", "--max-tokens", "1", "--json"],
                          capture_output=True, text=True, env=env, timeout=600)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"engine run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall, _children_cpu() - cpu, phases(proc.stderr)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_once(engine: list[str], env: dict[str, str]) -> tuple[float, list]:
    """(s from spawn until ``/health`` answers, phases) of one ``engine serve``, stopped with SIGINT after."""
    port = _free_port()
    log = tempfile.TemporaryFile(mode="w+")
    started = time.perf_counter()
    proc = subprocess.Popen([*engine, "serve", "--log-level", "debug", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=log, env=env, text=True)
    ready = None
    try:
        while ready is None and time.perf_counter() - started < 600:
            if proc.poll() is not None:
                log.seek(0)
                raise SystemExit(f"engine serve exited ({proc.returncode}):\n{log.read()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as answer:
                    if answer.status == 200:
                        ready = time.perf_counter() - started
            except OSError:
                time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.seek(0)
    return ready if ready is not None else float("nan"), phases(log.read())


def show(title: str, found: list) -> None:
    print(f"  {title}", flush=True)
    for name, took, at in found:
        took_text = f"{took:6.2f} s" if took is not None else " " * 8
        print(f"    {took_text}  at {at:6.2f} s  {name}", flush=True)


def first_token_at(found: list) -> float | None:
    return next((at for name, _, at in found if name.startswith("first step")), None)


def _variants(compare: str | None, env: dict[str, str]) -> list[tuple[str, list[str], dict[str, str]]]:
    """(label, command, environment) of this tree and, with ``--compare``, of the other tree."""
    variants = [("this tree", ENGINE, env)]
    if compare:
        root = tempfile.mkdtemp(prefix="pagedkv-compare-")
        os.symlink(Path(compare).resolve(), Path(root) / "pagedkv")
        other = {**env, "PYTHONPATH": root}
        variants.append((compare, [sys.executable, "-m", "pagedkv.cli.main"], other))
    return variants


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-serve", action="store_true", help="time `engine run` only")
    parser.add_argument("--compare", default=None, metavar="DIR", help="another pagedkv source tree, alternated")
    parser.add_argument("--fresh-cache", action="store_true",
                        help="round 1 in an empty PAGEDKV_CACHE (one-time conversions included), later rounds reuse it")
    args = parser.parse_args()
    env = dict(os.environ)
    fresh = tempfile.mkdtemp(prefix="pagedkv-startup-cache-") if args.fresh_cache else None
    if fresh:
        env["PAGEDKV_CACHE"] = fresh
    variants = _variants(args.compare, env)
    results: dict[str, dict[str, list[float]]] = {v[0]: {"first": [], "wall": [], "cpu": [], "serve": []}
                                                   for v in variants}
    try:
        for i in range(args.rounds):
            for label, engine, venv in variants if i % 2 == 0 else variants[::-1]:
                print(f"round {i + 1}, {label} (load average {_load()})", flush=True)
                wall, cpu, found = run_once(engine, venv)
                show(f"engine run --prompt hi --max-tokens 1 --json: wall {wall:.2f} s, CPU {cpu:.2f} s; phases",
                     found)
                got = results[label]
                got["wall"].append(wall)
                got["cpu"].append(cpu)
                got["first"].append(first_token_at(found) or float("nan"))
                if not args.no_serve:
                    ready, found = serve_once(engine, venv)
                    show(f"engine serve until /health answers: {ready:.2f} s; phases", found)
                    got["serve"].append(ready)
    finally:
        if fresh:
            shutil.rmtree(fresh, ignore_errors=True)
    warm = slice(1, None) if args.rounds > 1 else slice(None)
    for label, got in results.items():
        print(f"{label}: warm medians (rounds 2..{args.rounds}): first token at {_median(got['first'][warm])}, "
              f"run wall {_median(got['wall'][warm])}, run CPU {_median(got['cpu'][warm])}, serve ready "
              f"{_median(got['serve'][warm])}; round 1: first token at {_fmt(got['first'][0])}, run wall "
              f"{_fmt(got['wall'][0])}, serve ready {_fmt(got['serve'][0] if got['serve'] else None)}")
    print(f"load average at the end: {_load()}")
    return 0


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _median(values: list[float]) -> str:
    return _fmt(statistics.median(values)) if values else "-"


def _fmt(value: float | None) -> str:
    return f"{value:.2f} s" if value is not None else "-"


if __name__ == "__main__":
    sys.exit(main())
