"""Block pool micro-benchmark: allocate, free and revive at 1k, 100k and 1M blocks, against a reference pool.

Run: ``python benchmarks/micro/block_pool_revival.py`` (about ten seconds; ``--ref REV`` picks the reference pool,
``git show REV:core/kv/block_pool.py``, default ``main``; ``--sizes``, ``--rounds``).

- allocate: every block of a fresh pool, one ``allocate()`` each (plain blocks: the engine's hot path).
- free: those blocks back, one ``decref`` each.
- revive: in a pool whose blocks are all cached (a prefix cache kept every one), ``incref`` of cached
  blocks drawn at random positions of the free queue: what a prefix-cache hit does to each matched block.
  The revived blocks are released again, untimed, between rounds.

Both pools run in this process, alternating round by round; each figure is the median over rounds of the
nanoseconds per operation, measured with ``time.perf_counter``.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

from pagedkv.core.kv import block_pool

ROOT = Path(__file__).resolve().parents[1]
OPS = ("allocate", "free", "revive")


def reference_pool(rev: str) -> ModuleType:
    """The block pool module as it is at ``rev``, imported under another name."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:core/kv/block_pool.py"], check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "block_pool_ref.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("block_pool_ref", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_alloc_free(module: ModuleType, n: int) -> tuple[float, float]:
    """Seconds per allocate and per free over a whole fresh pool of ``n`` blocks."""
    pool = module.BlockPool(n)
    allocate, decref = pool.allocate, pool.decref
    start = time.perf_counter()
    blocks = [allocate() for _ in range(n)]
    mid = time.perf_counter()
    for block in blocks:
        decref(block)
    end = time.perf_counter()
    return (mid - start) / n, (end - mid) / n


class RevivalCase:
    """A pool of ``n`` cached blocks; each round revives blocks at random places in its free queue.

    Every pool gets the same picks. A revived block is released again (untimed) and so moves to the
    queue's left end: each round picks among the blocks no earlier round touched, so none is found there.
    """

    def __init__(self, module: ModuleType, n: int, revivals: int, rounds: int, seed: int) -> None:
        self.pool = module.BlockPool(n, on_release=lambda block: True)
        self.pool.decref_many(self.pool.allocate_many(n))
        picks = random.Random(seed).sample(range(n), revivals * rounds)
        self.rounds = [picks[i * revivals:(i + 1) * revivals] for i in range(rounds)]

    def time_revive(self) -> float:
        pool, picks = self.pool, self.rounds.pop()
        incref = pool.incref
        start = time.perf_counter()
        for block in picks:
            incref(block)
        elapsed = time.perf_counter() - start
        pool.decref_many(picks)  # cached again (the newest)
        return elapsed / len(picks)


def revivals_for(n: int) -> int:
    """Enough revivals to time, few enough that the reference's scans of a million-block queue take a second."""
    return max(20, min(1000, 10_000_000 // n))


def measure(pools: dict[str, ModuleType], n: int, rounds: int) -> dict[str, dict[str, float]]:
    """Median ns per operation of each pool at ``n`` blocks, the pools alternating each round."""
    samples: dict[str, dict[str, list[float]]] = {name: {op: [] for op in OPS} for name in pools}
    revivals = min(revivals_for(n), n // rounds)
    cases = {name: RevivalCase(module, n, revivals, rounds, seed=n) for name, module in pools.items()}
    for _ in range(rounds):
        for name, module in pools.items():
            alloc, free = time_alloc_free(module, n)
            samples[name]["allocate"].append(alloc)
            samples[name]["free"].append(free)
            samples[name]["revive"].append(cases[name].time_revive())
    return {name: {op: statistics.median(values) * 1e9 for op, values in by_op.items()}
            for name, by_op in samples.items()}


def table(results: dict[int, dict[str, dict[str, float]]], names: list[str]) -> str:
    head = f"{'blocks':>9}  {'op':<9}" + "".join(f"{name + ' ns/op':>16}" for name in names)
    lines = [head + (f"{'ratio':>9}" if len(names) == 2 else "")]
    for n, by_pool in results.items():
        for op in OPS:
            figures = [by_pool[name][op] for name in names]
            line = f"{n:>9,}  {op:<9}" + "".join(f"{f:>16,.0f}" for f in figures)
            if len(names) == 2:
                line += f"{figures[0] / figures[1]:>8.2f}x"
            lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", default="main", help="git revision of the reference pool (default: main)")
    ap.add_argument("--sizes", default="1000,100000,1000000", help="pool sizes, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    pools: dict[str, ModuleType] = {}
    try:
        pools[f"ref({args.ref})"] = reference_pool(args.ref)
    except (subprocess.CalledProcessError, OSError) as exc:
        print(f"no reference pool at {args.ref!r} ({exc}); timing this tree's alone", file=sys.stderr)
    pools["this tree"] = block_pool
    sizes = [int(s) for s in args.sizes.split(",")]
    results = {n: measure(pools, n, args.rounds) for n in sizes}
    print(f"block pool, median of {args.rounds} alternating rounds, Python {sys.version.split()[0]}")
    print(table(results, list(pools)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
