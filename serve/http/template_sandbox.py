"""Clients' chat templates: refused unless the server trusts them, then rendered in a process it can kill.

A chat template is a program. vLLM refuses one sent in a request (``chat_template``, or
``chat_template`` inside ``chat_template_kwargs``) unless the server was started with
``--trust-request-chat-template``; so does pagedkv, with a 400 naming the field. When trusted, a
request's template is rendered by a worker process (``serve/template_worker.py``), never on the
tokenizer's thread: the render has a time limit (the worker is killed at it and a fresh one is
started for the next render), its text stops at the most characters that could fit the context,
and the worker's address space is capped, so one template cannot hold the server, grow its memory
or stop it from obeying SIGTERM. All three answer 400 naming the field: the template is the
request's, and a retry would fail the same way (a 408 would invite the OpenAI SDK to retry it twice).

The model's own template is trusted and keeps the fast path (rendered on the tokenizer's thread).
Renders of clients' templates take turns on the one worker (each at most the time limit); one that
cannot get its turn within two time limits answers 503, so a queue of hostile templates cannot hold a
request, or a shutdown, for their sum.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import Any

from pagedkv.serve.api.errors import InvalidField

log = logging.getLogger("pagedkv.serve")

DEFAULT_TIME_LIMIT_S = 2.0  # a real template renders a 1,000-message chat in milliseconds
STARTUP_TIMEOUT_S = 30.0  # the worker imports jinja2 (~0.1 s); a loaded machine may take longer
BASE_ADDRESS_SPACE = 256 << 20  # the worker's interpreter, jinja2 and a request's data, with room to spare
HEADER_BYTES = 8
QUEUE_TURNS = 2  # a render waits at most this many time limits for the worker, then 503
TRUST_FLAG = "--trust-request-chat-template"


def request_template(body: Any, trusted: bool) -> tuple[str, str] | None:
    """(field, template) of the chat template ``body`` carries, None for the server's own.

    A 400 naming the field when the server does not trust request templates (vLLM's rule) or it is not a string.
    """
    nested = (body.chat_template_kwargs or {}).get("chat_template")
    if body.chat_template is not None:
        found = ("chat_template", body.chat_template)
    elif nested is not None:
        found = ("chat_template_kwargs", nested)
    else:
        return None
    field, template = found
    if not trusted:
        raise InvalidField(field, "this server does not render chat templates sent in requests (a template is "
                           f"code); its operator can allow them with {TRUST_FLAG}")
    if not isinstance(template, str):
        raise InvalidField(field, "a chat template must be a string")
    return found


class TemplateSandbox:
    """Renders requests' chat templates in a worker process, within a time, a length and a memory limit.

    ``special_tokens`` are the tokenizer's (templates read ``bos_token`` and the like, as transformers
    passes them); ``max_chars`` is the longest text worth rendering (longer cannot fit the context).
    """

    def __init__(self, special_tokens: dict[str, Any], max_chars: int,
                 time_limit_s: float = DEFAULT_TIME_LIMIT_S) -> None:
        self.special_tokens = dict(special_tokens)
        self.max_chars = max_chars
        self.time_limit_s = time_limit_s
        self.address_space = BASE_ADDRESS_SPACE + 16 * max_chars  # the text (up to 4 bytes a char), copies
        self._proc: Any = None
        self._lock: asyncio.Lock | None = None
        self._reaping: set[asyncio.Future] = set()

    async def render(self, field: str, conversation: list[dict[str, Any]], arguments: dict[str, Any]) -> str:
        """The conversation through the request's template (``arguments["chat_template"]``), as text.

        ``arguments`` are the chat template's keyword arguments as the chat route builds them. An
        :class:`InvalidField` naming ``field`` when the template fails, runs too long or writes too much.
        """
        # a 4 MiB body's conversation takes milliseconds to encode: on a thread, as bodies are parsed
        job = await asyncio.to_thread(_job, conversation, arguments, self.special_tokens, self.max_chars)
        if self._lock is None:
            self._lock = asyncio.Lock()
        try:  # a queue of hostile renders must not hold a request (or a shutdown) for their sum
            await asyncio.wait_for(self._lock.acquire(), QUEUE_TURNS * self.time_limit_s)
        except asyncio.TimeoutError:
            raise InvalidField(None, "the chat template sandbox is busy with other requests' templates; retry later",
                               503, "service_unavailable") from None
        try:
            answer = await self._exchange(field, job)
        finally:
            self._lock.release()
        if "text" in answer:
            return answer["text"]
        kind = answer.get("kind")
        if kind == "too_long":
            raise InvalidField(field, f"the chat template's text is over {self.max_chars:,} characters, more "
                               "than can fit in this model's context")
        if kind == "memory":
            raise InvalidField(field, "the chat template needs more memory than its sandbox allows")
        raise InvalidField(field, f"the chat template failed: {answer.get('error', 'unknown error')}")

    async def _exchange(self, field: str, job: bytes) -> dict[str, Any]:
        try:
            proc = await self._worker()
            proc.stdin.write(len(job).to_bytes(HEADER_BYTES, "big") + job)
            await proc.stdin.drain()
            reply = await asyncio.wait_for(_read_bytes(proc.stdout), self.time_limit_s)
        except asyncio.TimeoutError:
            self._kill()
            raise InvalidField(field, f"the chat template did not finish rendering within {self.time_limit_s:g} s "
                               "(it was stopped)") from None
        except (OSError, asyncio.IncompleteReadError, ValueError):
            self._kill()  # the worker died mid-render (out of memory beyond MemoryError, a crash): start afresh
            raise InvalidField(field, "the chat template's render was stopped (its sandbox ended)") from None
        except BaseException:  # the request was cancelled (its client left): the render must not go on
            self._kill()
            raise
        answer = await asyncio.to_thread(json.loads, reply)  # up to the context's worth of text
        if answer.get("kind") == "memory":
            self._kill()  # it exits after a MemoryError: the next render starts a fresh one
        return answer

    async def _worker(self) -> Any:
        if self._proc is not None and self._proc.returncode is None:
            return self._proc
        unavailable = InvalidField(None, "the chat template sandbox is not available", 503, "service_unavailable")
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "pagedkv.serve.template_worker", str(self.address_space),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        except OSError as exc:  # out of processes or descriptors: the server's trouble, not the request's
            log.error("could not start the chat template sandbox: %s", exc)
            raise unavailable from None
        try:
            ready = json.loads(await asyncio.wait_for(_read_bytes(self._proc.stdout), STARTUP_TIMEOUT_S))
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError):
            ready = None
        if not (isinstance(ready, dict) and ready.get("ready")):
            self._kill()
            log.error("the chat template sandbox did not start (%s -m pagedkv.serve.template_worker)", sys.executable)
            raise unavailable
        return self._proc

    def _kill(self) -> None:
        """Kill the worker (if any) and reap it in the background: its pipes close while the loop runs."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.stdin.close()
        if proc.returncode is None:
            try:
                proc.kill()
            except ProcessLookupError:  # it had just exited
                pass
        task = asyncio.ensure_future(_reap(proc))
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)

    async def aclose(self) -> None:
        """Stop the worker and wait until every worker is reaped (the server is shutting down)."""
        self._kill()
        if self._reaping:
            await asyncio.wait(set(self._reaping), timeout=STARTUP_TIMEOUT_S)


async def _reap(proc: Any) -> None:
    try:  # reads its stdout to the end and waits for its exit status
        await asyncio.wait_for(proc.communicate(), STARTUP_TIMEOUT_S)
    except (asyncio.TimeoutError, OSError, ValueError):
        pass


def _job(conversation: list[dict[str, Any]], arguments: dict[str, Any], special_tokens: dict[str, Any],
         max_chars: int) -> bytes:
    """The worker's job as JSON: apply_chat_template's named arguments apart, the rest are template variables."""
    variables = dict(arguments)
    named = {name: variables.pop(name, None) for name in
             ("chat_template", "tools", "documents", "add_generation_prompt", "continue_final_message")}
    return json.dumps({"template": named["chat_template"], "messages": conversation, "tools": named["tools"],
                       "documents": named["documents"], "add_generation_prompt": bool(named["add_generation_prompt"]),
                       "continue_final_message": bool(named["continue_final_message"]),
                       "variables": {**special_tokens, **variables}, "max_chars": max_chars}).encode("ascii")


async def _read_bytes(stream: asyncio.StreamReader) -> bytes:
    """One frame's JSON bytes."""
    size = int.from_bytes(await stream.readexactly(HEADER_BYTES), "big")
    return await stream.readexactly(size)
