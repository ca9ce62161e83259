"""Turning a request's engine outputs into OpenAI responses: one JSON body, or server-sent events.

A request here is one or more engine requests (one per prompt, each with ``n`` samples);
choice ``i`` of prompt ``p`` is OpenAI choice ``p * n + i``. Streams send only new text
per chunk; with stop strings the last ``len(stop) - 1`` characters wait until the next
output, so text that turns out to be the start of a stop string is never sent. With
``logprobs``, each chunk carries the logprobs of the tokens that arrived since the last chunk; with
``echo`` too, a completion's first chunk (or its whole answer) starts with the prompt's tokens' logprobs.
A streamed chat's role chunks go out with the first token, not at admission: a client timing the
first chunk measures the time to the first token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pagedkv.serve.api.errors import error_body
from pagedkv.serve.async_engine import Aborted, Evicted, RequestFailed, RequestHandle
from pagedkv.serve.chat_output import ChatDeltas
from pagedkv.serve.logprobs_format import chat_logprobs, completion_logprobs, prompt_logprobs_json


@dataclass
class Job:
    """What the route handler prepared: the engine requests of one HTTP request, and how to answer."""

    chat: bool
    response_id: str
    model: str
    n: int
    handles: list[RequestHandle]
    prompt_tokens: int
    holdback: int  # characters held back while streaming (longest stop string - 1)
    metrics: Any
    logprobs: int | None = None  # top-k alternatives per token when the request asked for logprobs
    texts: Any = None  # TokenTexts: each token's own text and bytes, for the logprobs
    shaper: Any = None  # ChatShaper: tool calls and reasoning parsed out of a chat answer (None: plain content)
    arrival: float = field(default_factory=time.perf_counter)
    created: int = field(default_factory=lambda: int(time.time()))
    echo: list[str] | None = None  # per prompt: text that starts each of its choices (vLLM's echo)
    prompt_ids: list[list[int]] | None = None  # per prompt, when the request asked for return_token_ids
    continuous_usage: bool = False  # usage so far on every streamed chunk (continuous_usage_stats)
    cached: dict[int, int] = field(default_factory=dict)  # prompt index -> its tokens found in the prefix cache
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone, the one token sampled left out

    def close(self) -> None:
        for handle in self.handles:
            handle.close()
            forget = getattr(self.metrics, "forget", None)
            if forget is not None:
                forget(handle.request_id)

    def visible(self, completion: Any) -> Any:
        """A choice as the answer shows it: with ``echo_only``, without the token the engine had to sample."""
        if not self.echo_only:
            return completion
        return dataclasses.replace(completion, text="", token_ids=[], cumulative_logprob=None,
                                   logprobs=None if completion.logprobs is None else [])

    def echoed(self, out: Any) -> tuple[list[int], list[Any]] | None:
        """(the prompt's ids, their logprobs entries) that lead a completion's logprobs under ``echo``."""
        if self.chat or not self.echo or self.logprobs is None or out.prompt_logprobs is None:
            return None
        return out.prompt_token_ids, out.prompt_logprobs

    def logprobs_of(self, completion: Any, start: int = 0, end: int | None = None, offset: int = 0,
                    prompt: tuple[list[int], list[Any]] | None = None) -> Any:
        """The OpenAI logprobs object for tokens ``start:end`` of a choice (None unless asked for), after the
        ``prompt`` tokens' when given (the echo)."""
        if self.logprobs is None or completion.logprobs is None:
            return None
        ids, entries = list(completion.token_ids[start:end]), list(completion.logprobs[start:end])
        if prompt is not None:
            ids, entries = [*prompt[0], *ids], [*prompt[1], *entries]
        if self.chat:
            return chat_logprobs(ids, entries, self.logprobs, self.texts)
        return completion_logprobs(ids, entries, self.logprobs, self.texts, offset)


class _Timer:
    """Per engine request: time to first token, inter-output latency, end-to-end latency, phase times."""

    def __init__(self, job: Job) -> None:
        self.job, self.last, self.first, self.first_token = job, None, True, None

    def observe(self, out: Any) -> None:
        now, m, arrival = time.perf_counter(), self.job.metrics, self.job.arrival
        phases = getattr(m, "phases", None)
        if self.first and any(c.token_ids for c in out.outputs):
            m.ttft.observe(now - arrival)
            self.first, self.first_token = False, now
            if phases is not None:
                phases(out.request_id, arrival, now, None)
        elif self.last is not None:
            m.itl.observe(now - self.last)
        self.last = now
        if out.finished:
            m.e2e.observe(now - arrival)
            for c in out.outputs:
                m.finished(c.finish_reason)
            if phases is not None:
                phases(out.request_id, arrival, self.first_token, now)
                m.request_prompt_tokens.observe(len(out.prompt_token_ids))
                m.request_generation_tokens.observe(sum(len(c.token_ids) for c in out.outputs))


async def _merged(job: Job) -> AsyncIterator[tuple[int, Any]]:
    """(prompt index, output) from every engine request of the job, as they come."""
    timers = [_Timer(job) for _ in job.handles]
    if len(job.handles) == 1:
        async for out in job.handles[0]:
            timers[0].observe(out)
            yield 0, out
        return
    # each pump waits until its output is taken, so a reader that stops reading leaves one output per prompt
    # here and the rest unread in the handles' mailboxes (replaced, not queued; aborted when stalled)
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        try:
            async for out in handle:
                timers[index].observe(out)
                taken = asyncio.Event()
                queue.put_nowait((index, out, taken))
                await taken.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((index, exc, None))
        queue.put_nowait((index, None, None))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(job.handles)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item, taken = await queue.get()
            if taken is not None:
                taken.set()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _error_of(completion: Any) -> str | None:
    if completion.finish_reason != "error":
        return None
    return completion.error or "the request failed"


async def collect(job: Job, pool: Any = None) -> tuple[int, dict[str, Any]]:
    """The whole answer as one JSON body (status, body); a failed request answers 500 with its error.

    A request the server ends early (the shutdown grace period is over) answers 200 with the
    text it has so far and finish reason ``abort``, as a stream would. The body is built on
    ``pool`` (an executor; None: asyncio's default), off the event loop: ``n=64`` answers with
    20 top logprobs per token are millions of entries to format.
    """
    finals: dict[int, Any] = {}  # prompt index -> its latest (cumulative) output
    aborted = False
    try:
        async for index, out in _merged(job):
            job.cached[index] = out.num_cached_tokens
            finals[index] = out
    except RequestFailed as exc:
        return 500, error_body(str(exc), "internal_server_error", code=500)
    except Evicted as exc:
        return 503, error_body(str(exc), "service_unavailable", code=503)
    except Aborted:
        aborted = True
    return await asyncio.get_running_loop().run_in_executor(pool, _body, job, finals, aborted)


def _body(job: Job, finals: dict[int, Any], aborted: bool) -> tuple[int, dict[str, Any]]:
    """(On a worker thread) the answer of ``collect`` from each prompt's final output."""
    choices, completion_tokens = [], 0
    for p in sorted(finals):
        for c in finals[p].outputs:
            if (error := _error_of(c)) is not None:
                return 500, error_body(error, "internal_server_error", code=500)
            completion_tokens += len(c.token_ids)  # with echo_only too: vLLM counts the token it had to sample
            c = job.visible(c)
            finish = c.finish_reason if c.finish_reason is not None or not aborted else "abort"
            logprobs = job.logprobs_of(c, prompt=job.echoed(finals[p]))
            choice: dict[str, Any] = {"index": p * job.n + c.index, "logprobs": logprobs,
                                      "finish_reason": finish, "stop_reason": c.stop_reason}
            text = (job.echo[p] if job.echo else "") + c.text
            if job.chat and job.shaper is not None:
                choice["message"], calls = job.shaper.message(text)
                if calls and c.finish_reason == "stop":
                    choice["finish_reason"] = "tool_calls"
            elif job.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
                if finals[p].prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(finals[p].prompt_logprobs, job.texts)
            if job.prompt_ids is not None:  # vLLM's return_token_ids
                if not job.chat:
                    choice["prompt_token_ids"] = job.prompt_ids[p]
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
    if aborted:  # choices (or whole prompts) that had produced nothing yet still get their place
        seen = {ch["index"] for ch in choices}
        for index in range(len(job.handles) * job.n):
            if index not in seen:
                empty = {"message": {"role": "assistant", "content": ""}} if job.chat else {"text": ""}
                choices.append({"index": index, "logprobs": None, "finish_reason": "abort", "stop_reason": None,
                                **empty})
    choices.sort(key=lambda ch: ch["index"])
    body = {"id": job.response_id, "object": "chat.completion" if job.chat else "text_completion",
            "created": job.created, "model": job.model, "choices": choices,
            "usage": _usage(job.prompt_tokens, completion_tokens, sum(job.cached.values()))}
    if job.chat and job.prompt_ids is not None:
        body["prompt_token_ids"] = job.prompt_ids[0]
    if job.chat and finals and finals[0].prompt_logprobs is not None:  # vLLM puts chat's at the top level
        body["prompt_logprobs"] = prompt_logprobs_json(finals[0].prompt_logprobs, job.texts)
    return 200, body


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Stream:
    """What one server-sent-event stream has sent so far, per choice, and how its next chunk is spelt."""

    def __init__(self, job: Job, include_usage: bool) -> None:
        self.job = job
        kind = "chat.completion.chunk" if job.chat else "text_completion"
        self.head = {"id": job.response_id, "object": kind, "created": job.created, "model": job.model}
        self.usage_field: dict[str, Any] = {"usage": None} if include_usage else {}
        self.sent: dict[int, int] = {}  # choice index -> characters sent
        self.done: set[int] = set()
        self.tokens: dict[int, int] = {}
        self.logprobs_sent: dict[int, int] = {}  # choice index -> tokens whose logprobs went out
        self.text_offset: dict[int, int] = {}  # choice index -> characters of token text so far (legacy text_offset)
        self.deltas: dict[int, ChatDeltas] = {}  # choice index -> its parsed deltas (with a shaper)
        self.token_ids_sent: dict[int, int] = {}  # choice index -> token ids that went out (return_token_ids)
        self.started: set[int] = set()  # choices whose first chunk went out (echo, prompt_token_ids)
        self.roles_sent = not job.chat  # a chat's role chunks wait for the first token

    def usage(self) -> dict[str, Any]:
        return _usage(self.job.prompt_tokens, sum(self.tokens.values()), sum(self.job.cached.values()))

    def roles(self) -> list[str]:
        """Each chat choice's role chunk, the first time this is asked (nothing after, nor for completions)."""
        if self.roles_sent:
            return []
        self.roles_sent = True
        return [self.chunk(index, None, None, role=True) for index in range(len(self.job.handles) * self.job.n)]

    def advance(self, index: int, c: Any, prompt: tuple[list[int], list[Any]] | None = None,
                sampled: int | None = None) -> str | None:
        """The chunk for choice ``index``'s latest output ``c`` (None: nothing new to send yet); ``prompt``:
        the echoed prompt's ids and logprobs, which lead the choice's first chunk; ``sampled``: the tokens the
        usage counts, when ``c`` shows fewer (echo_only)."""
        job = self.job
        self.tokens[index] = len(c.token_ids) if sampled is None else sampled
        finished = c.finish_reason is not None
        end = len(c.text) if finished else max(self.sent.get(index, 0), len(c.text) - job.holdback)
        text = c.text[self.sent.get(index, 0):end]
        self.sent[index] = end
        fields = None
        if job.chat and job.shaper is not None:
            fields = self.deltas.setdefault(index, ChatDeltas(job.shaper)).delta(text, finished)
        if finished:
            self.done.add(index)
            reason = c.finish_reason
            if fields is not None and self.deltas[index].calls and reason == "stop":
                reason = "tool_calls"
            return self.chunk(index, text, reason, c.stop_reason, logprobs=self._new_logprobs(index, c, prompt), c=c,
                              fields=fields)
        if (fields if fields is not None else text) or (index not in self.started and job.echo):
            return self.chunk(index, text, None, logprobs=self._new_logprobs(index, c, prompt), c=c, fields=fields)
        return None

    def _new_logprobs(self, index: int, c: Any, prompt: tuple[list[int], list[Any]] | None) -> Any:
        start, end = self.logprobs_sent.get(index, 0), len(c.token_ids)
        self.logprobs_sent[index] = end
        prompt = prompt if index not in self.started else None  # (the chunk marks it started afterwards)
        result = self.job.logprobs_of(c, start, end, self.text_offset.get(index, 0), prompt)
        if result is not None and not self.job.chat:
            self.text_offset[index] = self.text_offset.get(index, 0) + sum(map(len, result["tokens"]))
        return result

    def chunk(self, index: int, text: str | None, finish: str | None, stop_reason: Any = None, role: bool = False,
              logprobs: Any = None, c: Any = None, fields: dict[str, Any] | None = None) -> str:
        job = self.job
        text, extra = self._first_and_ids(index, text, role, c)
        if job.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if fields is not None:
                delta.update(fields)
            elif text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        top = {"prompt_token_ids": extra.pop("top_prompt_token_ids")} if "top_prompt_token_ids" in extra else {}
        choice.update(extra)
        usage = {"usage": self.usage()} if job.continuous_usage and not role else self.usage_field
        return _sse({**self.head, **top, "choices": [choice], **usage})

    def _first_and_ids(self, index: int, text: str | None, role: bool, c: Any) -> tuple[str | None, dict[str, Any]]:
        """A choice's first chunk carries the echo and the prompt's ids; each carries its new token ids."""
        job, extra = self.job, {}
        if not role and index not in self.started:
            self.started.add(index)
            if job.echo:
                text = job.echo[index // job.n] + (text or "")
            if job.prompt_ids is not None and not job.chat:
                extra["prompt_token_ids"] = job.prompt_ids[index // job.n]
            elif job.prompt_ids is not None and job.chat:
                extra["top_prompt_token_ids"] = job.prompt_ids[index // job.n]
        if job.prompt_ids is not None and c is not None:
            start = self.token_ids_sent.get(index, 0)
            extra["token_ids"] = list(c.token_ids[start:])
            self.token_ids_sent[index] = len(c.token_ids)
        return text, extra


async def stream_events(job: Job, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events for the job, ending in ``data: [DONE]``; leaving early aborts every request."""
    stream = _Stream(job, include_usage)
    choices = len(job.handles) * job.n
    try:
        try:
            async for p, out in _merged(job):
                job.cached[p] = out.num_cached_tokens
                if not stream.roles_sent and not (out.finished or any(c.token_ids for c in out.outputs)):
                    continue  # prefill still running: nothing exists to send yet
                for chunk in stream.roles():
                    yield chunk
                prompt = job.echoed(out)
                for c in out.outputs:
                    index = p * job.n + c.index
                    if index in stream.done:
                        continue
                    if (error := _error_of(c)) is not None:
                        yield _sse(error_body(error, "internal_server_error", code=500))
                        yield "data: [DONE]\n\n"
                        return
                    if (chunk := stream.advance(index, job.visible(c), prompt, len(c.token_ids))) is not None:
                        yield chunk
        except RequestFailed as exc:
            for chunk in stream.roles():
                yield chunk
            yield _sse(error_body(str(exc), "internal_server_error", code=500))
            yield "data: [DONE]\n\n"
            return
        except Evicted as exc:  # never ran, so nothing was sent but the 200: the queue-full answer as an event
            yield _sse(error_body(str(exc), "service_unavailable", code=503))
            yield "data: [DONE]\n\n"
            return
        except Aborted:  # the server is stopping: every open choice ends here, cleanly
            for chunk in stream.roles():
                yield chunk
            for index in range(choices):
                if index not in stream.done:
                    yield stream.chunk(index, None, "abort")
        for chunk in stream.roles():  # (a stream that ended without any output)
            yield chunk
        if include_usage:
            yield _sse({**stream.head, "choices": [], "usage": stream.usage()})
        yield "data: [DONE]\n\n"
    finally:
        job.close()
