"""The sandbox for requests' chat templates, driven directly: its time limit, its queue bound, its clean stop."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedkv.serve.api.errors import InvalidField
from pagedkv.serve.http.template_sandbox import QUEUE_TURNS, TemplateSandbox

SILENT_LOOPS = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"
MESSAGES = [{"role": "user", "content": "hi"}]


def arguments(template: str) -> dict:
    return {"chat_template": template, "add_generation_prompt": True, "continue_final_message": False, "tools": None,
            "greeting": "hey"}


def test_a_render_gets_the_request_arguments_and_the_special_tokens():
    async def run() -> str:
        sandbox = TemplateSandbox({"bos_token": "<s>"}, max_chars=1000)
        try:
            return await sandbox.render("chat_template", MESSAGES, arguments(
                "{{ bos_token }}{{ greeting }}{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}>{% endif %}"))
        finally:
            await sandbox.aclose()

    assert asyncio.run(run()) == "<s>heyuser:hi>"


def test_renders_queued_behind_hostile_ones_wait_at_most_their_turns_then_503():
    limit = 0.5

    async def run() -> list[tuple[int, float]]:
        sandbox = TemplateSandbox({}, max_chars=1000, time_limit_s=limit)
        await sandbox.render("chat_template", MESSAGES, arguments("ok"))  # the worker is up

        async def one() -> tuple[int, float]:
            started = time.monotonic()
            try:
                await sandbox.render("chat_template", MESSAGES, arguments(SILENT_LOOPS))
            except InvalidField as exc:
                return exc.status, time.monotonic() - started
            return 200, time.monotonic() - started

        try:
            return await asyncio.gather(*(one() for _ in range(4)))
        finally:
            await sandbox.aclose()

    answers = asyncio.run(run())
    statuses = sorted(status for status, _ in answers)
    assert statuses[0] == 400 and statuses[-1] == 503, answers  # the first is stopped, the last never gets a turn
    assert all(status in (400, 503) for status in statuses)
    waited = [seconds for status, seconds in answers if status == 503]
    assert all(QUEUE_TURNS * limit - 0.05 <= s < QUEUE_TURNS * limit + 1.5 for s in waited), answers


def test_a_cancelled_render_stops_the_worker():
    async def run() -> None:
        sandbox = TemplateSandbox({}, max_chars=1000, time_limit_s=30)
        await sandbox.render("chat_template", MESSAGES, arguments("ok"))
        worker = sandbox._proc
        task = asyncio.ensure_future(sandbox.render("chat_template", MESSAGES, arguments(SILENT_LOOPS)))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.wait_for(worker.wait(), 5) is not None  # killed, not left rendering for 30 s
        assert await sandbox.render("chat_template", MESSAGES, arguments("again")) == "again"
        await sandbox.aclose()

    asyncio.run(run())
