"""A bystander's inter-token latency beside a request whose grammar masks are slow (issue 42, row 2).

The tiny random Llama over the byte tokenizer; the bystander decodes ``--tokens`` tokens greedily (EOS
ignored), alone ("quiet") and beside a request constrained to one long literal (``--literal`` bytes: each of
its masks costs ~0.25 ms per kB here, more with a real vocabulary). The literal is compiled before timing,
so only masks count. ITL = wall time between the bystander's successive tokens, from engine.step; rounds
alternate quiet / attacked in fresh engines; torch runs ``--threads`` threads. Prints the p50 / p99 ITL of
each, the attacked/quiet ratios per round, how many gaps exceeded 2 ms, and the step loop's time off the CPU
per token (wall minus the loop thread's CPU time: a stall from the OS or the GIL, not from work).

    .venv/bin/python benchmarks/micro/grammar_bystander.py [--literal 400000] [--tokens 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import fields

import torch

from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.core.sample.structured_output import StructuredOutputs
from pagedkv.testing import BYTE_VOCAB, byte_tokenizer, tiny_llama


def make_engine(literal_bytes: int) -> Engine:
    config = {"device": "cpu", "num_blocks": 512, "block_size": 16}
    if "max_grammar_bytes" in {f.name for f in fields(EngineConfig)}:
        config["max_grammar_bytes"] = literal_bytes + 1024  # the size limit would refuse the attack outright
    return Engine(EngineConfig(**config), model=tiny_llama(vocab_size=BYTE_VOCAB, num_hidden_layers=1,
                                                                  max_position_embeddings=4096),
                  tokenizer=byte_tokenizer())


def bystander_itl(engine: Engine, tokens: int, literal: str | None) -> tuple[list[float], float]:
    """The bystander's inter-token gaps and the step loop's seconds off the CPU while it decoded."""
    if literal is not None:
        constraint = StructuredOutputs(grammar=f'start: "{literal}"')
        engine.check_structured(constraint)
        engine.add_request("x", SamplingParams(max_tokens=100_000, structured=constraint), request_id="attack")
        while not any(s.matcher is not None for s in engine.scheduler.running):  # the attack is decoding
            engine.step()
    engine.add_request("y", SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), request_id="by")
    stamps: list[float] = []
    seen = 0
    wall, cpu = time.perf_counter(), time.thread_time()
    while True:
        for out in engine.step():
            if out.request_id == "by" and len(out.outputs[0].token_ids) > seen:
                seen = len(out.outputs[0].token_ids)
                stamps.append(time.perf_counter())
        if seen >= tokens:
            break
    off_cpu = (time.perf_counter() - wall) - (time.thread_time() - cpu)
    engine.abort("attack")
    return [b - a for a, b in zip(stamps, stamps[1:])], off_cpu


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--literal", type=int, default=400_000)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: no pool for a mask to stall)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    literal = "".join(rng.choice("abcdefghij klmnop") for _ in range(args.literal))
    runs: dict[str, list[tuple[list[float], float]]] = {"quiet": [], "attacked": []}
    for _ in range(args.rounds):
        runs["quiet"].append(bystander_itl(make_engine(args.literal), args.tokens, None))
        runs["attacked"].append(bystander_itl(make_engine(args.literal), args.tokens, literal))
    for name, rounds in runs.items():
        p50 = statistics.median(pct(r, 0.5) for r, _ in rounds) * 1e3
        p99 = statistics.median(pct(r, 0.99) for r, _ in rounds) * 1e3
        total = statistics.median(sum(r) for r, _ in rounds)
        over = sum(sum(1 for gap in r if gap > 0.002) for r, _ in rounds)
        off = statistics.median(off for _, off in rounds) / args.tokens * 1e3
        print(f"{name:9s} ITL p50 {p50:7.2f} ms  p99 {p99:7.2f} ms  {args.tokens} tokens in {total:.2f} s  "
              f"gaps > 2 ms: {over} in {args.rounds} rounds  loop off-CPU {off:.3f} ms/token")
    for q_name, q in (("p50", 0.5), ("p99", 0.99)):
        ratio = [pct(a, q) / pct(b, q) for (b, _), (a, _) in zip(runs["quiet"], runs["attacked"])]
        print(f"{q_name} attacked/quiet per round: {', '.join(f'{r:.2f}' for r in ratio)} "
              f"(median {statistics.median(ratio):.2f})")


if __name__ == "__main__":
    main()
