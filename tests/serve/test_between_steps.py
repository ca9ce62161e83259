"""``engine serve`` sizes the step's threads between steps (issue 43, item 5): the async engine calls its
``between_steps`` hook on the loop thread before every step, and the CLI gives it ``ThreadShare.tick`` on a
one-process CPU engine with ``--adapt-threads``."""

from __future__ import annotations

import argparse
import asyncio
import threading

from serve_helpers import tiny_chat_engine

from pagedkv.cli.serve import _thread_share, add_arguments
from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.serve.async_engine import AsyncEngine
from pagedkv.serve.testing import byte_level_tokenizer


def test_the_hook_runs_on_the_loop_thread_before_every_step():
    engine = tiny_chat_engine(byte_level_tokenizer())
    calls: list[tuple[str, int]] = []
    owner: AsyncEngine | None = None

    def hook() -> None:
        calls.append((threading.current_thread().name, owner.steps))

    owner = AsyncEngine(engine, between_steps=hook)

    async def main() -> None:
        handle = await owner.add([1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), "r")
        async for _ in handle:
            pass

    owner.start()
    try:
        asyncio.run(main())
    finally:
        owner.stop()
    assert owner.steps >= 5
    assert [name for name, _ in calls] == ["pagedkv-engine"] * owner.steps
    assert [steps for _, steps in calls] == list(range(owner.steps))  # before each step, one call a step


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


class _Engine:
    def __init__(self, device: str, tp: int = 1) -> None:
        self.config = argparse.Namespace(device=device, tensor_parallel_size=tp)


def test_serve_adapts_threads_on_cpu_when_asked_and_not_elsewhere():
    assert _args().adapt_threads is False  # a benchmark client on the same machine would count as a neighbour
    assert _thread_share(_Engine("cpu"), _args()) is None
    assert callable(_thread_share(_Engine("cpu"), _args("--adapt-threads")))
    assert _thread_share(_Engine("cuda:0"), _args("--adapt-threads")) is None
    assert _thread_share(_Engine("cpu", tp=2), _args("--adapt-threads")) is None  # each worker steps its own shard


def test_start_releases_the_starting_threads_openmp_pool_before_the_loop_runs():
    engine = tiny_chat_engine(byte_level_tokenizer())
    seen: list[tuple[str, bool]] = []

    def release() -> bool:
        loop_running = any(t.name == "pagedkv-engine" for t in threading.enumerate())
        seen.append((threading.current_thread().name, loop_running))
        return True

    owner = AsyncEngine(engine, release_pool=release)
    owner.start()
    owner.stop()
    assert seen == [(threading.current_thread().name, False)]  # on the loading thread, the loop not yet started
