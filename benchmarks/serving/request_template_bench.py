"""Request chat templates (issue 42 row 1): what the sandbox costs a normal request, what a hostile one costs.

    python benchmarks/serving/request_template_bench.py              # tiny random Llama, SmolLM2's tokenizer
    python benchmarks/serving/request_template_bench.py --rounds 5 --requests 40 --json out.json

One ``engine serve --trust-request-chat-template`` (127.0.0.1). Overhead: ``/tokenize`` of a 3-message chat
through the model's template (the tokenizer thread) against the same template sent as ``chat_template``
(the sandbox worker), alternated in rounds, medians of per-request latency. Hostile: the issue's nested loop,
a loop that writes nothing (held to the time limit) and ``{{ 'x' * 300000000 }}``, each while a prober GETs
``/health`` every 20 ms: the answer and its time, /health p50/p99/max, the server's RSS before and after.
Last, SIGTERM during a render that writes nothing: seconds to exit, exit status, tracebacks in the log.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HOSTILE = {
    "nested-loops (the issue's)": "{% for a in range(99999) %}{% for b in range(99999) %}x{% endfor %}{% endfor %}",
    "silent nested loops": "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}",
    "'x' * 300000000": "{{ 'x' * 300000000 }}",
}
MESSAGES = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is the capital?"},
            {"role": "assistant", "content": "Paris."}]


def start(model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    from hostile_client import _free_port

    port = _free_port()
    engine = Path(sys.executable).with_name("engine")
    proc = subprocess.Popen([str(engine), "serve", "--model", str(model), "--port", str(port), "--device", "cpu",
                             "--num-blocks", "256", "--block-size", "16", "--log-level", "warning",
                             "--trust-request-chat-template"], stdout=subprocess.DEVNULL, stderr=log.open("w"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("engine serve did not come up: " + log.read_text()[-2000:])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def overhead(client: httpx.Client, template: str, rounds: int, requests: int) -> dict:
    """Median /tokenize latency (ms) through the model's template and through the sandbox, alternated."""
    times: dict[str, list[float]] = {"model": [], "sandbox": []}
    bodies = {"model": {"messages": MESSAGES}, "sandbox": {"messages": MESSAGES, "chat_template": template}}
    assert client.post("/tokenize", json=bodies["model"]).json() == client.post("/tokenize",
                                                                                 json=bodies["sandbox"]).json()
    for _ in range(rounds):
        for kind in ("model", "sandbox"):
            for _ in range(requests):
                started = time.perf_counter()
                assert client.post("/tokenize", json=bodies[kind]).status_code == 200
                times[kind].append((time.perf_counter() - started) * 1000)
    model, sandbox = statistics.median(times["model"]), statistics.median(times["sandbox"])
    return {"model_ms": round(model, 2), "sandbox_ms": round(sandbox, 2), "extra_ms": round(sandbox - model, 2),
            "requests_each": rounds * requests}


def hostile(url: str, pid: int, name: str, template: str) -> dict:
    latencies: list[float] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=url, timeout=30) as prober:
            while not done.is_set():
                started = time.perf_counter()
                prober.get("/health")
                latencies.append((time.perf_counter() - started) * 1000)
                time.sleep(0.02)

    before = rss_mib(pid)
    thread = threading.Thread(target=probe)
    thread.start()
    started = time.monotonic()
    answer = httpx.post(url + "/v1/chat/completions", timeout=120,
                        json={"messages": MESSAGES[:2], "max_tokens": 1, "chat_template": template})
    seconds = time.monotonic() - started
    done.set()
    thread.join()
    started = time.monotonic()  # the next request template: a fresh worker after a kill or a MemoryError
    assert httpx.post(url + "/tokenize", json={"messages": MESSAGES, "chat_template": "{{ messages[0].content }}"},
                      timeout=60).status_code == 200
    next_ms = (time.monotonic() - started) * 1000
    time.sleep(1.0)
    ordered = sorted(latencies)
    return {"attack": name, "status": answer.status_code, "seconds": round(seconds, 2),
            "message": answer.json()["error"]["message"][:90] if answer.status_code != 200 else "",
            "health_p50_ms": round(ordered[len(ordered) // 2], 1),
            "health_p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 1),
            "health_max_ms": round(ordered[-1], 1), "health_probes": len(ordered), "next_render_ms": round(next_ms),
            "rss_before_mib": round(before, 1), "rss_after_mib": round(rss_mib(pid), 1)}


def sigterm_during_render(proc: subprocess.Popen, url: str, log: Path) -> dict:
    body = {"messages": MESSAGES[:2], "max_tokens": 1, "chat_template": HOSTILE["silent nested loops"]}

    def post() -> None:
        try:
            httpx.post(url + "/v1/chat/completions", timeout=60, json=body)
        except httpx.HTTPError:
            pass

    threading.Thread(target=post, daemon=True).start()
    time.sleep(0.5)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    return {"exit_seconds": round(time.monotonic() - started, 2), "exit_code": code,
            "tracebacks": log.read_text().count("Traceback")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=40, help="requests per kind per round")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from hostile_client import tiny_model_dir
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model_dir(Path(tmp))
        template = AutoTokenizer.from_pretrained(model).chat_template
        log = Path(tmp) / "server.log"
        proc, url = start(model, log)
        try:
            with httpx.Client(base_url=url, timeout=60) as client:
                result = {"overhead": overhead(client, template, args.rounds, args.requests)}
            result["hostile"] = [hostile(url, proc.pid, name, body) for name, body in HOSTILE.items()]
            result["sigterm"] = sigterm_during_render(proc, url, log)
        finally:
            if proc.poll() is None:
                proc.kill()
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
