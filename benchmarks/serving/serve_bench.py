"""Serving benchmark: a seeded chat workload against any OpenAI-compatible server, streamed over HTTP.

    python benchmarks/serving/serve_bench.py --url http://127.0.0.1:8000 --rate inf --rate 2
    python benchmarks/serving/serve_bench.py --num-requests 16 --rate inf --rate 1 \\
        --launch "pagedkv=engine serve --model DIR --port 8100" \\
        --launch "hf-cb=transformers serve DIR --continuous-batching --device cpu --port 8101" \\
        --json benchmarks/serve_results.json --plot benchmarks/plots/serve.png

Every request is a streamed chat completion (greedy, ``max_tokens`` drawn from a seeded
uniform range); arrivals are all at once (``--rate inf``) or Poisson at the given rate
(requests/s). Per run it reports request throughput, output tokens/s, and p50/p90/p99 of
time to first token (TTFT), inter-token latency (ITL, gaps between content chunks) and
end-to-end latency. With ``--launch LABEL=CMD`` every server is started first (the port
is read from ``--port N`` in CMD); then each rate runs on each server in turn (interleaved,
so a shared machine's changing load hits all alike); then they are stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

TOPICS = [
    "Explain how a paged KV cache saves memory in LLM inference.",
    "Write a short poem about the sea at night.",
    "What are three tips for learning a new programming language?",
    "Summarize the plot of a detective story in a few sentences.",
    "Why is the sky blue? Answer simply.",
    "Give me a recipe for a quick vegetable soup.",
    "Describe the water cycle to a ten-year-old.",
    "What is the difference between a list and a tuple in Python?",
    "Tell me a fun fact about octopuses.",
    "How do I politely decline a meeting invitation?",
    "List some good habits for a healthy sleep schedule.",
    "What happened during the French Revolution, briefly?",
]


@dataclass
class Request:
    messages: list[dict[str, str]]
    max_tokens: int
    arrival: float  # seconds after the start of the run


@dataclass
class Result:
    ok: bool
    output_tokens: int = 0
    ttft: float = math.nan
    e2e: float = math.nan
    itls: list[float] = field(default_factory=list)
    error: str = ""


def workload(num: int, rate: float, min_out: int, max_out: int, seed: int) -> list[Request]:
    """The same prompts and lengths for a given seed; Poisson arrival times at ``rate`` (inf: all at once)."""
    rng = random.Random(seed)
    arrivals = random.Random(seed + 1)
    t, requests = 0.0, []
    for i in range(num):
        topic = TOPICS[rng.randrange(len(TOPICS))]
        requests.append(Request([{"role": "user", "content": f"{topic} (request {i})"}],
                                rng.randint(min_out, max_out), t))
        if math.isfinite(rate):
            t += arrivals.expovariate(rate)
    return requests


async def one(client: Any, url: str, model: str, req: Request, start: float) -> Result:
    await asyncio.sleep(max(0.0, start + req.arrival - time.perf_counter()))
    body = {"model": model, "messages": req.messages, "max_tokens": req.max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    result, last, chunks = Result(ok=False), None, 0
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return Result(ok=False, error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("error"):
                    return Result(ok=False, error=str(event["error"])[:200])
                if event.get("usage"):
                    result.output_tokens = event["usage"].get("completion_tokens", 0)
                for choice in event.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        if last is None:
                            result.ttft = now - sent
                        else:
                            result.itls.append(now - last)
                        last = now
                        chunks += 1
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        return Result(ok=False, error=f"{type(exc).__name__}: {exc}")
    result.e2e = time.perf_counter() - sent
    result.output_tokens = result.output_tokens or chunks  # a server without usage: one token per chunk
    result.ok = True
    return result


def percentile(values: list[float], q: float) -> float:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return math.nan
    k = (len(values) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def stream_rate(result: Result) -> float:
    """Tokens/s of one stream after its first token: what one user waiting on it sees (NaN under two tokens)."""
    decode = result.e2e - result.ttft
    return (result.output_tokens - 1) / decode if result.output_tokens > 1 and decode > 0 else math.nan


async def run_workload(url: str | list[str], requests: list[Request], timeout: float,
                       one_at_a_time: bool = False) -> dict[str, Any]:
    """Send ``requests`` (request i to ``urls[i % len(urls)]`` when given several servers) and summarise;
    ``one_at_a_time``: each is sent when the one before has ended (batch 1), arrival times ignored."""
    import httpx

    urls = [url] if isinstance(url, str) else list(url)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1000)) as client:
        model = (await client.get(urls[0] + "/v1/models")).json()["data"][0]["id"]
        start = time.perf_counter()
        if one_at_a_time:
            results = [await one(client, urls[i % len(urls)], model, replace(r, arrival=0.0), time.perf_counter())
                       for i, r in enumerate(requests)]
        else:
            results = await asyncio.gather(*(one(client, urls[i % len(urls)], model, r, start)
                                             for i, r in enumerate(requests)))
        elapsed = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "requests": len(requests), "ok": len(ok), "elapsed_s": round(elapsed, 2),
        "req_per_s": round(len(ok) / elapsed, 3), "output_tok_per_s": round(tokens / elapsed, 2),
        "output_tokens": tokens, "errors": sorted({r.error for r in results if not r.ok})[:3],
    }
    for name, values in (("ttft", [r.ttft for r in ok]), ("itl", [x for r in ok for x in r.itls]),
                         ("e2e", [r.e2e for r in ok])):
        for q in (50, 90, 99):
            summary[f"{name}_p{q}_s"] = round(percentile(values, q), 4)
    summary["stream_tok_per_s_p50"] = round(percentile([stream_rate(r) for r in ok], 50), 2)
    return summary


def port_of(command: str) -> int:
    found = re.search(r"--port[= ](\d+)", command)
    if not found:
        raise SystemExit(f"--launch command needs --port N: {command}")
    return int(found.group(1))


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server at {url} not ready after {timeout} s")


def measure_one(label: str, url: str, rate: float, args: argparse.Namespace) -> dict[str, Any]:
    requests = workload(args.num_requests, rate, args.min_output, args.max_output, args.seed)
    warm = workload(2, math.inf, 4, 4, args.seed + 99)
    asyncio.run(run_workload(url, warm, args.timeout))  # first-request costs (lazy loads) out of the numbers
    summary = asyncio.run(run_workload(url, requests, args.timeout))
    row = {"server": label, "rate": "inf" if math.isinf(rate) else rate, **summary}
    print(json.dumps(row), flush=True)
    return row


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ["server", "rate", "ok", "elapsed_s", "req_per_s", "output_tok_per_s", "ttft_p50_s", "ttft_p90_s",
            "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s", "e2e_p99_s"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row.get(c)) for c in cols) + " |")


def plot(rows: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    servers = list(dict.fromkeys(r["server"] for r in rows))
    finite = sorted({r["rate"] for r in rows if r["rate"] != "inf"})
    top = (max(finite) * 2) if finite else 1.0
    for server in servers:
        mine = sorted((top if r["rate"] == "inf" else r["rate"], r) for r in rows if r["server"] == server)
        xs = [x for x, _ in mine]
        left.plot(xs, [r["output_tok_per_s"] for _, r in mine], marker="o", label=server)
        right.plot(xs, [r["ttft_p99_s"] for _, r in mine], marker="o", label=server)
    for ax, title in ((left, "output tokens/s"), (right, "p99 TTFT (s)")):
        ax.set_xlabel(f"request rate (req/s; {top:g} = all at once)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    right.set_yscale("log")
    left.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", action="append", default=[], help="LABEL=URL or URL of a running server")
    parser.add_argument("--launch", action="append", default=[], help="LABEL=COMMAND: start, measure, stop")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--rate", action="append", type=float, default=None, help="req/s; inf = all at once")
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1200.0, help="per request, seconds")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--json", default=None, help="append the rows to this JSON file")
    parser.add_argument("--plot", default=None, help="save throughput / p99 TTFT vs rate here (matplotlib)")
    args = parser.parse_args(argv)
    args.rate = args.rate or [math.inf]
    servers: list[tuple[str, str]] = []
    for spec in args.url:
        label, _, url = spec.rpartition("=") if "=" in spec else ("", "", spec)
        servers.append((label or url, url.rstrip("/")))
    procs = []
    rows: list[dict[str, Any]] = []
    try:
        for spec in args.launch:  # all started up front, measured in turn: an idle server costs ~nothing
            label, _, command = spec.partition("=")
            url = f"http://127.0.0.1:{port_of(command)}"
            procs.append(subprocess.Popen(shlex.split(command), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True))
            wait_ready(url, procs[-1], args.ready_timeout)
            servers.append((label, url))
        # interleaved: every rate runs on every server before the next rate, so a change in the load of a
        # shared machine hits all servers alike
        for rate in args.rate:
            for label, url in servers:
                rows.append(measure_one(label, url, rate, args))
    finally:
        for proc in procs:
            stop(proc)
    print_table(rows)
    if args.json:
        previous = json.load(open(args.json)) if os.path.exists(args.json) else []
        with open(args.json, "w") as f:
            json.dump(previous + [{"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows,
                                   "args": {k: str(v) for k, v in vars(args).items()}}], f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
