"""The server awaits a grammar compile instead of waiting for it on a worker thread (issue 42, row 4): a
hundred requests whose compiles are slow hold none of the threads that parse, template and tokenize for
everyone else, and each still gets its compile's answer."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from pagedkv.core.sample.grammar_backend import GrammarError
from pagedkv.core.sample.structured_output import StructuredOutputs
from pagedkv.serve.api.errors import InvalidField
from pagedkv.serve.structured_request import compile_check


class SlowCompiles:
    """An engine whose compiles finish only when the test says so."""

    def __init__(self) -> None:
        self.pending: list[Future] = []
        self.release = threading.Event()

    def submit_structured(self, constraint, client=""):
        future: Future = Future()
        self.pending.append(future)
        return future

    def check_structured(self, constraint, client=""):  # the blocking form (today's server used it)
        self.release.wait(5)
        future = self.submit_structured(constraint, client)
        future.set_result(object())


def test_slow_compiles_hold_no_worker_thread_and_each_gets_its_answer():
    engine = SlowCompiles()

    async def scenario():
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(4))
        checks = [asyncio.create_task(compile_check(engine, StructuredOutputs(regex=f"r{i}"), "guided_regex"))
                  for i in range(100)]
        await asyncio.sleep(0.2)
        # another request's parsing / tokenizing still finds a worker thread at once
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "parsed"), 2) == "parsed"
        for i, future in enumerate(engine.pending):
            if i % 2:
                future.set_exception(GrammarError("took too long"))
            else:
                future.set_result(object())
        return await asyncio.gather(*checks, return_exceptions=True)

    try:
        results = asyncio.run(scenario())
    finally:
        engine.release.set()
    assert len(engine.pending) == 100
    assert [r is None for r in results] == [True, False] * 50
    for refused in results[1::2]:
        assert isinstance(refused, InvalidField) and "took too long" in str(refused)


def test_a_disconnect_does_not_cancel_a_compile_other_requests_share():
    engine = SlowCompiles()

    async def scenario():
        check = asyncio.create_task(compile_check(engine, StructuredOutputs(regex="r"), "guided_regex"))
        await asyncio.sleep(0.05)
        check.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await check

    asyncio.run(scenario())
    assert not engine.pending[0].cancelled()
