"""Suite 5 of issue 7: block alloc/free/append operations per second, and scheduler step time at 64, 1k, 10k
sequences, and how the cost grows.

Run: ``python -m pytest benchmarks/micro/test_allocator_scheduler.py --benchmark-only -q -s``.

Block operations run on the real ``BlockPool`` and ``PagedAllocator`` (no plugins, no telemetry: the
engine's default hot path). Their baseline, in the same group and the same run, is the bare data-structure
work a pool cannot avoid (a ``deque`` pop + a list store, and the reverse), so the ratio says how much the
pool's bookkeeping (ref counts, event calls, checks) adds on top of Python itself.

Scheduler steps run through ``Engine(config, runner=SimulatedRunner(SmolLM2 shape))``: N sequences with
256-token prompts, prefilled by the simulator, then timed decode steps (one token each, nothing finishing).
``engine.step()`` is the whole CPU side of a step without the model (schedule, the stand-in runner, sampling of a
one-column logits tensor, appending tokens, the finish checks, stats); ``scheduler.schedule()`` is timed
inside it, and ``ModelRunner.pack`` + ``build_metadata`` (the step batch and attention metadata) are timed on the
same step's output. The baseline is one bare Python pass over the N running sequences reading two
attributes, measured in the same test; ``per seq`` columns show whether the cost grows linearly.
``finish`` times ``scheduler.finish`` of 50 random running sequences (the list removal is O(N)).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections import deque
from types import SimpleNamespace

import pytest
from bench_common import facts

from pagedkv.core.kv.allocator import PagedAllocator
from pagedkv.core.kv.block_pool import BlockPool
from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.core.sched.sequence import Sequence

OPS = 20_000
SIZES = (64, 1000, 10_000)
PROMPT = 256
_rows: dict = {}



def _median_s(benchmark) -> float:
    return benchmark.stats.stats.median


# --- block operations ------------------------------------------------------------------------------------


def _baseline_alloc_free():
    free = deque(range(OPS))
    refs = [0] * OPS
    taken = []
    for _ in range(OPS):
        b = free.popleft()
        refs[b] = 1
        taken.append(b)
    for b in taken:
        refs[b] = 0
        free.append(b)


def _pool_alloc_free():
    pool = BlockPool(OPS)
    taken = [pool.allocate("r") for _ in range(OPS)]
    for b in taken:
        pool.decref(b, "r")


def _append_tokens():
    """One sequence grows by OPS tokens, one ``allocate_slots`` call per token (a new block every 16)."""
    pool = BlockPool(OPS // 16 + 2)
    alloc = PagedAllocator(pool, 16)
    seq = Sequence("r", [1], SamplingParams(max_tokens=OPS), max_len=OPS + 1)
    for _ in range(OPS):
        alloc.allocate_slots(seq, 1)
        seq.num_computed_tokens += 1
    alloc.free(seq)


def _baseline_append():
    blocks, computed = [], 0
    for _ in range(OPS):
        need = -(-(computed + 1) // 16) - len(blocks)
        if need > 0:
            blocks.append(computed)
        computed += 1


def _alloc_free_sequences():
    """OPS blocks' worth of 16-block sequences: allocate_slots for 256 tokens, then free, per sequence."""
    pool = BlockPool(16 * 64)
    alloc = PagedAllocator(pool, 16)
    seqs = [Sequence(str(i), [1] * 256, SamplingParams(), max_len=512) for i in range(OPS // 16)]
    for start in range(0, len(seqs), 64):
        batch = seqs[start:start + 64]
        for s in batch:
            assert alloc.allocate_slots(s, 256)
        for s in batch:
            alloc.free(s)


BLOCK_CASES = {
    "baseline: deque pop/append + list store": (_baseline_alloc_free, 2 * OPS, "ops"),
    "BlockPool.allocate + decref": (_pool_alloc_free, 2 * OPS, "ops"),
    "baseline: bare cdiv + list append per token": (_baseline_append, OPS, "tokens"),
    "PagedAllocator.allocate_slots(seq, 1) per token": (_append_tokens, OPS, "tokens"),
    "allocate_slots(seq, 256) + free, 16 blocks a sequence": (_alloc_free_sequences, 2 * OPS, "block ops"),
}


@pytest.mark.parametrize("case", list(BLOCK_CASES))
@pytest.mark.benchmark(group="allocator: block operations")
def test_block_ops(benchmark, case):
    fn, ops, unit = BLOCK_CASES[case]
    benchmark.pedantic(fn, rounds=7, iterations=1, warmup_rounds=1)
    per_s = ops / _median_s(benchmark)
    _rows[case] = per_s
    benchmark.extra_info.update(ops_per_round=ops, unit=unit, per_second=round(per_s), loadavg=os.getloadavg())
    print(f"\n[block ops] {case}: {per_s / 1e6:.2f} M {unit}/s ({1e9 / per_s:.0f} ns each); {facts()}")


def test_block_ops_summary(benchmark):
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    if len(_rows) < len(BLOCK_CASES):
        pytest.skip("run the whole module for the ratios")
    names = list(BLOCK_CASES)
    pool_ratio = _rows[names[0]] / _rows[names[1]]
    append_ratio = _rows[names[2]] / _rows[names[3]]
    print(f"\n[block ops summary] BlockPool alloc+free: {_rows[names[1]] / 1e6:.2f} M ops/s = {pool_ratio:.1f}x the "
          f"cost of the bare deque/list baseline; allocate_slots per token: {_rows[names[3]] / 1e6:.2f} M tokens/s = "
          f"{append_ratio:.1f}x its baseline; whole-sequence alloc+free: {_rows[names[4]] / 1e6:.2f} M block ops/s; "
          f"{facts()}")


# --- scheduler steps --------------------------------------------------------------------------------------


def decoding_engine(n: int):
    """A simulated engine with ``n`` sequences past their prefill, each decoding one token per step."""
    from pagedkv.core.config import EngineConfig
    from pagedkv.core.engine import Engine
    from pagedkv.sim.simulate import SimSetup
    from pagedkv.sim.simulated_runner import SimulatedRunner

    blocks = n * (-(-(PROMPT + 64) // 16))
    engine = Engine(
        EngineConfig(num_blocks=blocks, max_num_seqs=n, max_num_batched_tokens=n * PROMPT, block_size=16,
                     max_model_len=PROMPT + 1000),
        runner=SimulatedRunner(SimSetup().model_config),  # SmolLM2-135M's shape; a plain Engine steps one by one
    )
    for i in range(n):
        engine.add_request([2 + i % 1000] + [0] * (PROMPT - 1), SamplingParams(max_tokens=500, ignore_eos=True))
    engine.step(stream=False)  # the prefill of all n
    assert len(engine.scheduler.running) == n and not engine.scheduler.waiting
    return engine


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.benchmark(group="scheduler: decode step (simulated engine)")
def test_scheduler_step(benchmark, n):
    from pagedkv.core.model.model_runner import ModelRunner

    engine = decoding_engine(n)
    sched = engine.scheduler
    schedule = sched.schedule
    sched_times: list[float] = []

    def timed_schedule():
        t = time.perf_counter()
        out = schedule()
        sched_times.append(time.perf_counter() - t)
        return out

    sched.schedule = timed_schedule
    rounds = 20 if n <= 1000 else 7
    benchmark.pedantic(engine.step, kwargs={"stream": False}, rounds=rounds, iterations=1, warmup_rounds=1)
    out = engine.runner.last
    assert len(out.scheduled) == n and all(item.num_new_tokens == 1 for item in out.scheduled)
    step_s = _median_s(benchmark)
    sched_s = statistics.median(sched_times[1:])

    fake_runner = SimpleNamespace(spec=SimpleNamespace(block_size=16), device="cpu")
    meta_times = []
    for _ in range(5):
        t = time.perf_counter()
        ModelRunner.build_metadata(fake_runner, ModelRunner.pack(fake_runner, out))
        meta_times.append(time.perf_counter() - t)
    meta_s = statistics.median(meta_times)

    running = sched.running
    base_times = []
    for _ in range(5):
        t = time.perf_counter()
        total = 0
        for seq in running:
            total += seq.num_computed_tokens + len(seq.output_token_ids)
        base_times.append(time.perf_counter() - t)
    base_s = statistics.median(base_times)

    rng = random.Random(0)
    victims = rng.sample(running, 50)
    t = time.perf_counter()
    for seq in victims:
        sched.finish(seq, "abort")
    finish_s = (time.perf_counter() - t) / 50

    row = {"n": n, "step_ms": step_s * 1e3, "schedule_ms": sched_s * 1e3, "metadata_ms": meta_s * 1e3,
           "baseline_ms": base_s * 1e3, "finish_us": finish_s * 1e6, "load1": os.getloadavg()[0]}
    _rows[n] = row
    benchmark.extra_info.update({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    print(f"\n[scheduler] {n} decoding sequences: engine.step {step_s * 1e3:.2f} ms ({step_s / n * 1e6:.2f} us/seq), "
          f"schedule {sched_s * 1e3:.2f} ms ({sched_s / n * 1e6:.2f} us/seq), build_metadata {meta_s * 1e3:.2f} ms "
          f"({meta_s / n * 1e6:.2f} us/seq), bare Python pass {base_s * 1e3:.3f} ms -> step = "
          f"{step_s / base_s:.0f}x the bare pass; finish one of {n} running: {finish_s * 1e6:.1f} us; {facts()}")


def test_scheduler_summary(benchmark):
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    rows = [_rows[n] for n in SIZES if n in _rows]
    if len(rows) < 2:
        pytest.skip("run the whole module for the growth table")
    print(f"\n[scheduler summary] decode steps, simulated engine, prompt {PROMPT}; {facts()}")
    print(f"  {'seqs':>6} {'step ms':>8} {'us/seq':>7} {'sched ms':>8} {'us/seq':>7} {'meta ms':>8} {'us/seq':>7} "
          f"{'x bare':>6} {'finish us':>9} {'load1':>5}")
    for r in rows:
        n = r["n"]
        print(f"  {n:>6} {r['step_ms']:>8.2f} {r['step_ms'] * 1e3 / n:>7.2f} {r['schedule_ms']:>8.2f} "
              f"{r['schedule_ms'] * 1e3 / n:>7.2f} {r['metadata_ms']:>8.2f} {r['metadata_ms'] * 1e3 / n:>7.2f} "
              f"{r['step_ms'] / r['baseline_ms']:>6.0f} {r['finish_us']:>9.1f} {r['load1']:>5.2f}")
    first, last = rows[0], rows[-1]
    growth = (last["step_ms"] / last["n"]) / (first["step_ms"] / first["n"])
    print(f"  per-sequence step cost at {last['n']} vs {first['n']} sequences: {growth:.2f}x "
          f"(1.0 = linear growth of the step); finish cost {last['finish_us'] / first['finish_us']:.1f}x "
          f"for {last['n'] / first['n']:.0f}x the sequences")
