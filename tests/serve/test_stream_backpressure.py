"""A reader that stops reading (issue 42, row 8): its outputs do not pile up, and its request is ended.

The engine's outputs are cumulative snapshots; an unread one is replaced by the next (vLLM's
RequestOutputCollector), and a request whose reader leaves an output unread for ``stall_timeout``
seconds is aborted, its KV blocks back in the pool.
"""

from __future__ import annotations

import asyncio
import gc
import time

import pytest
from serve_helpers import tiny_chat_engine

from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.core.sched.sequence import RequestOutput
from pagedkv.serve.async_engine import Aborted, AsyncEngine
from pagedkv.serve.testing import byte_level_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


async def _until(check, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_an_unread_request_holds_one_snapshot_not_one_per_step(tokenizer):
    engine = tiny_chat_engine(tokenizer)
    owner = AsyncEngine(engine)

    async def main() -> None:
        params = SamplingParams(max_tokens=120, n=4, temperature=0.0, ignore_eos=True)
        handle = await owner.add([1, 2, 3], params, "unread")
        await _until(lambda: not engine.has_unfinished() and owner.steps >= 120)
        await asyncio.sleep(0.1)  # the last step's hand-over runs on this loop
        gc.collect()
        held = sum(type(o) is RequestOutput for o in gc.get_objects())
        assert held <= 1, f"{held} snapshots queued for a reader that never read"
        first = await handle.__anext__()  # nothing is lost: the newest snapshot has every token
        assert first.finished and all(len(c.token_ids) == 120 for c in first.outputs)

    owner.start()
    try:
        asyncio.run(main())
    finally:
        owner.stop()


def test_a_reader_that_stops_reading_is_aborted_and_its_blocks_freed(tokenizer):
    engine = tiny_chat_engine(tokenizer)
    owner = AsyncEngine(engine, stall_timeout=0.3)

    async def main() -> None:
        params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        handle = await owner.add([1, 2, 3], params, "stalled")
        await handle.__anext__()  # the reader reads once, then stops
        started = time.monotonic()
        await _until(lambda: not engine.has_unfinished())
        assert engine.pool.num_used == 0
        assert time.monotonic() - started < 30
        with pytest.raises(Aborted, match="took no output"):
            await handle.__anext__()
        handle.close()
        # a reader that keeps reading is not touched, however long its answer
        reading = await owner.add([4, 5], SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True), "ok")
        outs = [out async for out in reading]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 300

    owner.start()
    try:
        asyncio.run(main())
    finally:
        owner.stop()
