"""Start-up time of `engine run --prompt hi --max-tokens 1` and `engine serve` (issue 26), phase by phase.

Each round runs, in fresh processes, ``engine --log-level debug run --prompt hi --max-tokens 1 --json``
(wall time to exit; "first token at" is the time since the process started at which the first step
ended) and ``engine serve --log-level debug --port P`` (wall time from spawn until ``GET /health``
answers 200; then SIGINT). The phase lines are those ``pagedkv.core.startup_phases`` logs. The first
round of a session may be cold (the page cache, the CPU kernel's cached build); read warm figures
from the later rounds. ``--fresh-cache`` points ``PAGEDKV_CACHE`` at an empty directory for the first
round, so it pays the one-time conversions (GGUF to safetensors, kernel build) as a new user does.

    python benchmarks/startup.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import re
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

ENGINE = str(Path(sys.executable).with_name("engine"))
PHASE = re.compile(r"^pagedkv\.startup: DEBUG: (?P<name>.+?)(?: (?P<took>[\d.]+) s)? \(at (?P<at>[\d.]+) s\)$")


def phases(stderr: str) -> list[tuple[str, float | None, float]]:
    """(name, seconds or None, seconds since the process started) per phase line."""
    found = []
    for line in stderr.splitlines():
        m = PHASE.match(line.strip())
        if m:
            found.append((m["name"], float(m["took"]) if m["took"] else None, float(m["at"])))
    return found


def run_once(env: dict[str, str]) -> tuple[float, list]:
    started = time.perf_counter()
    proc = subprocess.run([ENGINE, "--log-level", "debug", "run", "--prompt", "hi", "--max-tokens", "1", "--json"],
                          capture_output=True, text=True, env=env, timeout=600)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"engine run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall, phases(proc.stderr)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_once(env: dict[str, str]) -> tuple[float, list]:
    port = _free_port()
    log = tempfile.TemporaryFile(mode="w+")
    started = time.perf_counter()
    proc = subprocess.Popen([ENGINE, "serve", "--log-level", "debug", "--port", str(port)],
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


def show(kind: str, wall: float, found: list) -> None:
    print(f"  {kind}: {wall:.2f} s", flush=True)
    for name, took, at in found:
        took_text = f"{took:6.2f} s" if took is not None else " " * 8
        print(f"    {took_text}  at {at:6.2f} s  {name}", flush=True)


def first_token_at(found: list) -> float | None:
    return next((at for name, _, at in found if name.startswith("first step")), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-serve", action="store_true", help="time `engine run` only")
    parser.add_argument("--fresh-cache", action="store_true",
                        help="round 1 in an empty PAGEDKV_CACHE (one-time conversions included), later rounds reuse it")
    args = parser.parse_args()
    env = dict(os.environ)
    fresh = tempfile.mkdtemp(prefix="pagedkv-startup-cache-") if args.fresh_cache else None
    if fresh:
        env["PAGEDKV_CACHE"] = fresh
    runs: list[float] = []
    firsts: list[float] = []
    serves: list[float] = []
    try:
        for i in range(args.rounds):
            print(f"round {i + 1} (load average {' '.join(f'{x:.2f}' for x in os.getloadavg())})", flush=True)
            wall, found = run_once(env)
            show("engine run --prompt hi --max-tokens 1 --json, wall", wall, found)
            runs.append(wall)
            first = first_token_at(found)
            if first is not None:
                firsts.append(first)
            if not args.no_serve:
                ready, found = serve_once(env)
                show("engine serve until /health answers", ready, found)
                serves.append(ready)
    finally:
        if fresh:
            shutil.rmtree(fresh, ignore_errors=True)
    warm = slice(1, None) if args.rounds > 1 else slice(None)
    print(f"warm medians (rounds 2..{args.rounds}): first token at {_median(firsts[warm])}, run wall "
          f"{_median(runs[warm])}, serve ready {_median(serves[warm])}; round 1: first token at "
          f"{_fmt(firsts[0] if firsts else None)}, run wall {_fmt(runs[0])}, serve ready "
          f"{_fmt(serves[0] if serves else None)}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


def _median(values: list[float]) -> str:
    return _fmt(statistics.median(values)) if values else "-"


def _fmt(value: float | None) -> str:
    return f"{value:.2f} s" if value is not None else "-"


if __name__ == "__main__":
    sys.exit(main())
