"""Soak: thousands of requests through a small pool with every plugin on, on a tiny random Llama.

    python benchmarks/e2e/soak.py --requests 2000          # the documented soak (a few minutes on 2 cores)
    python benchmarks/e2e/soak.py --requests 60 --json     # what tests/core/test_soak.py runs

Reports requests completed, blocks leaked (must be 0), RSS at start and end,
preemptions and swaps. Exits 1 if any block leaked or any request went missing.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time


def rss_mib() -> float:
    """Current resident set size (Linux /proc), falling back to the peak."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * resource.getpagesize() / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def tiny_llama(seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def soak(requests: int, seed: int = 0, num_blocks: int = 48, block_size: int = 8) -> dict:
    from pagedkv import Engine, EngineConfig, SamplingParams
    from pagedkv.core.invariants import check_invariants

    rng = random.Random(seed)
    config = EngineConfig(device="cpu", num_blocks=num_blocks, block_size=block_size, max_num_seqs=16,
                          max_num_batched_tokens=128, enable_prefix_caching=True, enable_copy_on_write=True,
                          swap_space=num_blocks // 2 * 2 * 2 * block_size * 2 * 16 * 4, seed=seed)
    engine = Engine(config, model=tiny_llama(seed))
    system = [rng.randrange(1, 211) for _ in range(20)]
    rss_start = rss_mib()
    started = time.perf_counter()
    submitted, finished, aborted = set(), set(), set()
    pending = requests
    while pending or engine.has_unfinished():
        while pending and len(engine.scheduler.waiting) < 8:  # keep a queue, as a server would
            prompt = (system if rng.random() < 0.5 else []) + [rng.randrange(1, 211) for _ in range(rng.randint(1, 60))]
            n = rng.choice([1, 1, 1, 2, 3])
            params = SamplingParams(n=n, max_tokens=rng.randint(1, 48), temperature=0.0 if n == 1 else 0.9,
                                    seed=rng.randrange(10**6), ignore_eos=True)
            submitted.add(engine.add_request(prompt, params))
            pending -= 1
        for out in engine.step(stream=False):
            finished.add(out.request_id)
        if submitted - finished - aborted and rng.random() < 0.01:  # the odd client hangs up
            victim = rng.choice(sorted(submitted - finished - aborted))
            engine.abort(victim)
            aborted.add(victim)
    check_invariants(engine)
    swap = engine.pm.get_plugin("cpu_swap.instance")
    leaked = engine.num_blocks - engine.pool.num_available
    cpu_leaked = swap.cpu_pool.num_blocks - swap.cpu_pool.num_free if swap and swap.cpu_pool else 0
    stats = engine.plugin_stats()
    return {
        "requests_submitted": len(submitted),
        "requests_completed": len(finished),
        "requests_aborted": len(aborted),
        "requests_missing": len(submitted - finished - aborted),
        "blocks_leaked": leaked,
        "cpu_blocks_leaked": cpu_leaked,
        "rss_start_mib": round(rss_start, 1),
        "rss_end_mib": round(rss_mib(), 1),
        "preemptions": engine.stats.preemptions,
        "swap_outs": stats.get("swap_outs", 0),
        "prefix_hit_rate": stats.get("prefix_hit_rate", 0.0),
        "cow_copies": stats.get("cow_copies", 0),
        "generated_tokens": engine.stats.generated_tokens,
        "steps": engine.stats.steps,
        "elapsed_s": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report = soak(args.requests, args.seed)
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>20}: {value}")
    ok = report["blocks_leaked"] == 0 and report["cpu_blocks_leaked"] == 0 and report["requests_missing"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
