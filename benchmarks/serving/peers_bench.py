"""pagedkv against the engines a CPU user would otherwise pick, one server at a time, in one run.

    .venv/bin/python benchmarks/serving/peers_bench.py                      # 32 chats at once, 2 rounds
    .venv/bin/python benchmarks/serving/peers_bench.py --num-requests 32 --num-requests 128 --rounds 3
    .venv/bin/python benchmarks/serving/peers_bench.py --peers vllm,llamacpp --pagedkv auto,torch

Each installed peer is started with its recipe in ``$PEERS_DIR`` (default ``/work/shared/peers``, see its
README; the peers themselves live in ``$PEERS``, default ``/tmp/peers``), measured with the streamed-chat
client of serve_bench.py (greedy, ``max_tokens`` drawn from 16..128), and stopped before the next server
starts: on a small machine two servers would share its cores. Servers alternate round by round
(A, B, C, A, B, C...), so a shared machine's drifting load hits all alike. A peer that is not installed is
skipped with the reason. The table gives output tok/s, TTFT and inter-token p50/p99 (medians over rounds), the
load average before each server's runs, and each server's throughput as a ratio of vLLM CPU's in its best
configuration (compiled, both cores; "vllm" here) measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common, workload, paged_case

from bench_common import REPO as ROOT  # noqa: E402
from bench_common import model_dir  # noqa: E402
from serve_bench import run_workload, stop, wait_ready, workload  # noqa: E402  (beside this file)

from pagedkv import openmp_env  # noqa: E402

PEERS_DIR = Path(os.environ.get("PEERS_DIR", "/work/shared/peers"))
PEERS = Path(os.environ.get("PEERS", "/tmp/peers"))
REFERENCE = "vllm"


@dataclass
class Server:
    label: str
    command: list[str]
    env: dict[str, str]
    missing: str = ""  # why it cannot run here ("" = it can)
    ready_timeout: float = 600.0
    replicas: int = 1  # > 1: that many copies of ``command`` on consecutive ports, requests dealt round-robin


def peer_servers(names: list[str], port: int, threads: int) -> list[Server]:
    """The peers asked for, each with the reason it is skipped if it is not installed."""
    servers = []
    cores = f"0-{threads - 1}"
    for name in names:
        if name in ("vllm", "vllm-eager"):
            env = {"VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_TARGET_DEVICE": "cpu",
                   **({"EAGER": "1"} if name == "vllm-eager" else {})}
            python = PEERS / "vllm" / "venv" / "bin" / "python"
            missing = "" if python.exists() else f"not installed ({python} missing; {PEERS_DIR}/vllm_install.sh)"
            servers.append(Server(name, ["bash", str(PEERS_DIR / "vllm_start.sh"), str(port)], env, missing, 900))
        elif name == "llamacpp":
            binary = PEERS / "llamacpp" / "build-server" / "bin" / "llama-server"
            gguf = Path(os.environ.get("GGUF", PEERS / "models" / "SmolLM2-135M-Instruct-f32.gguf"))
            missing = next((f"not installed ({p} missing; {PEERS_DIR}/llamacpp_install.sh)"
                            for p in (binary, gguf) if not p.exists()), "")
            servers.append(Server(name, ["bash", str(PEERS_DIR / "llamacpp_start.sh"), str(port)],
                                  {"THREADS": str(threads)}, missing))
        elif name == "transformers":
            exe = ROOT / ".venv" / "bin" / "transformers"
            model = model_dir()
            missing = "" if exe.exists() else f"not installed ({exe} missing)"
            servers.append(Server(name, [str(exe), "serve", model, "--continuous-batching", "--device", "cpu",
                                         "--port", str(port)], {}, missing))
        else:
            raise SystemExit(f"unknown peer {name!r}: vllm, vllm-eager, llamacpp, transformers")
    return servers


def pagedkv_servers(backends: list[str], port: int, threads: int, replicas: list[int]) -> list[Server]:
    """One server per backend, and per replica count N > 1 N independent servers of ``threads // N`` threads
    each: what data-parallel replicas behind one endpoint would give, without the router."""
    exe = str(ROOT / ".venv" / "bin" / "engine")
    servers = []
    for b in backends:
        for n in replicas:
            label = f"pagedkv-{b}" if n == 1 else f"pagedkv-{b}-dp{n}x{max(1, threads // n)}t"
            servers.append(Server(label, [exe, "serve", "--port", str(port), "--backend", b, "--threads",
                                          str(max(1, threads // n)), "--log-level", "warning"], {}, replicas=n))
    return servers


def start(server: Server, port: int) -> list[tuple[str, subprocess.Popen]]:
    """``server``'s processes (one per replica, on ports ``port``, ``port + 1``...) with their URLs."""
    started = []
    for i in range(server.replicas):
        command = [str(port + i) if arg == str(port) else arg for arg in server.command]
        env = {**openmp_env.environ_without_ours(), **server.env}  # peers keep their own OpenMP defaults
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        started.append((f"http://127.0.0.1:{port + i}", proc))
    return started


def measure(server: Server, port: int, counts: list[int], args: argparse.Namespace) -> list[dict]:
    """Start ``server``, run every request count once (after a two-request warm-up), stop it."""
    load = os.getloadavg()[0]
    started = start(server, port)
    urls = [url for url, _ in started]
    rows = []
    try:
        for url, proc in started:
            wait_ready(url, proc, server.ready_timeout)
        asyncio.run(run_workload(urls, workload(2 * len(urls), math.inf, 4, 4, args.seed + 99), args.timeout))
        for n in counts:
            requests = workload(n, math.inf, args.min_output, args.max_output, args.seed)
            summary = asyncio.run(run_workload(urls, requests, args.timeout))
            rows.append({"server": server.label, "requests": n, "load": load, **summary})
            print(f"  {server.label:<16} {n:>4} chats: {summary['output_tok_per_s']:7.1f} tok/s, TTFT p99 "
                  f"{summary['ttft_p99_s']:.2f} s, ok {summary['ok']}/{n}, load before {load:.1f}", flush=True)
    finally:
        for _, proc in started:
            stop(proc)
    return rows


def table(rows: list[dict], servers: list[Server], counts: list[int]) -> str:
    lines = ["| server | chats | output tok/s | TTFT p50 s | TTFT p99 s | ITL p50 ms | ITL p99 ms | load | "
             f"x {REFERENCE} |", "|---|---|---|---|---|---|---|---|---|"]
    for n in counts:
        mine = {s.label: [r for r in rows if r["server"] == s.label and r["requests"] == n] for s in servers}
        ref = mine.get(REFERENCE) or []
        ref_tps = statistics.median(r["output_tok_per_s"] for r in ref) if ref else None
        for s in servers:
            got = mine[s.label]
            if not got:
                lines.append(f"| {s.label} | {n} | skipped: {s.missing or 'no result'} | | | | | | |")
                continue

            def med(key: str, got: list[dict] = got) -> float:
                return statistics.median(r[key] for r in got)

            tps = med("output_tok_per_s")
            loads = "/".join(f"{r['load']:.1f}" for r in got)
            ratio = f"{tps / ref_tps:.2f}" if ref_tps else f"n/a ({REFERENCE} not measured)"
            lines.append(f"| {s.label} | {n} | {tps:.1f} | {med('ttft_p50_s'):.2f} | {med('ttft_p99_s'):.2f} | "
                         f"{1e3 * med('itl_p50_s'):.0f} | {1e3 * med('itl_p99_s'):.0f} | "
                         f"{loads} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", default="vllm,llamacpp", help="comma list: vllm, vllm-eager, llamacpp, "
                        "transformers")
    parser.add_argument("--pagedkv", default="auto", help="comma list of pagedkv backends to serve with")
    parser.add_argument("--num-requests", type=int, action="append", default=None, help="chats sent at once")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--pagedkv-replicas", default="1", help="comma list of replica counts N: N pagedkv "
                        "servers of threads/N threads each, requests dealt round-robin (data-parallel estimate)")
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8310)
    parser.add_argument("--timeout", type=float, default=1800.0, help="per request, seconds")
    args = parser.parse_args(argv)
    counts = args.num_requests or [32]
    peers = peer_servers([p for p in args.peers.split(",") if p], args.port, args.threads)
    replicas = [int(n) for n in args.pagedkv_replicas.split(",") if n]
    servers = peers + pagedkv_servers([b for b in args.pagedkv.split(",") if b], args.port, args.threads, replicas)
    for s in servers:
        if s.missing:
            print(f"skipping {s.label}: {s.missing}")
    runnable = [s for s in servers if not s.missing]
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} cores; threads {args.threads}; "
          f"chats {counts}; max_tokens {args.min_output}..{args.max_output}; rounds {args.rounds}; "
          f"order {[s.label for s in runnable]}", flush=True)
    rows: list[dict] = []
    for r in range(args.rounds):
        print(f"round {r + 1}", flush=True)
        for server in runnable:
            rows += measure(server, args.port, counts, args)
    print(table(rows, servers, counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
