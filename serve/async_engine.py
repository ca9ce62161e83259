"""The engine loop on its own thread, fed and drained from asyncio (vLLM's AsyncLLM, in small).

The :class:`~pagedkv.core.engine.Engine` is not thread-safe, so only the loop thread
touches it. The asyncio side puts ``add`` and ``abort`` commands in an inbox; the loop
takes them between steps (requests that arrive while it steps join the next step:
continuous batching across HTTP clients), steps while anything is unfinished, and
sleeps on a condition when idle. Each step's outputs go to their requests' mailboxes
(``stream_mailbox``: the newest snapshot only) with one ``call_soon_threadsafe`` per step;
a request whose reader leaves an output unread for ``stall_timeout`` seconds (a client
that stopped reading its stream) is aborted there, its KV blocks freed.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from pagedkv.core.errors import RequestRejected
from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.core.sched.sequence import RequestOutput
from pagedkv.openmp_env import release_thread_pool
from pagedkv.serve.stream_mailbox import Mailbox

SWITCH_INTERVAL_S = 0.0005  # see AsyncEngine.start

log = logging.getLogger("pagedkv.serve")


class QueueFull(Exception):
    """The waiting queue is at ``max_waiting``: answered 503 with Retry-After."""


class Evicted(QueueFull):
    """A waiting request pushed out of the full queue by a newcomer of a strictly better priority:
    answered as a full queue is (503 with Retry-After)."""


class ShuttingDown(Exception):
    """The server is stopping: no new requests."""


class RequestFailed(Exception):
    """The request ended with an error inside a step (its own, or the step's)."""


class Aborted(Exception):
    """The server ended the request early (shutdown grace period over): finish reason ``abort``."""


class StreamStalled(Aborted):
    """The reader took no output for ``stall_timeout`` seconds (it stopped reading): the request was aborted."""


@dataclass
class _Stream:
    request_id: str
    loop: asyncio.AbstractEventLoop
    mailbox: Mailbox = field(default_factory=Mailbox)
    accepted: asyncio.Future | None = None


class AsyncEngine:
    """Runs ``engine`` on a thread; :meth:`generate` streams one request's outputs to a coroutine.

    ``max_waiting`` bounds the sequences waiting for a first step (queued adds included, each
    counted with its ``n`` samples, so one ``n=64`` request cannot overfill a queue of 8);
    ``on_step`` is called on the loop thread after every step with the engine (metrics);
    ``stall_timeout`` (seconds, None: never) ends a request whose reader leaves an output unread
    that long (:class:`StreamStalled`); ``between_steps`` is called on the loop thread before every step
    (``core/thread_share.py``'s ``ThreadShare.tick``: the step's threads sized to the free cores);
    ``release_pool`` is called on the thread that calls :meth:`start` (the one that loaded the model) just
    before the loop thread starts (``openmp_env.release_thread_pool``: one OpenMP pool, the loop thread's).

    Under a priority scheduler a full queue is not the last word: a newcomer whose ``priority`` is
    strictly better than that of a waiting request that never ran evicts it (worst priority first,
    newest among equals; whole requests, only as many as make room, none if that cannot make room).
    The evicted request ends with :class:`Evicted`. The loop thread decides, over the scheduler's queue
    (:meth:`~pagedkv.core.engine.Engine.evictable`), and ends it with ``Engine.abort``.
    """

    def __init__(self, engine: Any, max_waiting: int = 256, on_step: Callable[[Any], None] | None = None,
                 stall_timeout: float | None = None, between_steps: Callable[[], None] | None = None,
                 release_pool: Callable[[], object] = release_thread_pool) -> None:
        self.engine = engine
        self.release_pool = release_pool
        self.between_steps = between_steps
        self.max_waiting = max_waiting
        self.on_step = on_step
        self.stall_timeout = stall_timeout
        self.steps = 0  # steps run (written by the loop thread; malloc_trim's sign of activity)
        self._cv = threading.Condition()
        # ("add", (stream, prompt, params, options, evicting)) / ("abort", request_id) / ("abort_all", None)
        self._inbox: list[tuple[str, Any]] = []
        self._pending_adds = 0  # adds in the inbox: counted as waiting
        self._waiting = 0  # the scheduler's waiting queue after the last step (written by the loop thread)
        self._evicts = bool(getattr(engine.scheduler, "uses_priority", False))
        self._worst_waiting: int | None = None  # the largest waiting priority (a hint; the loop thread decides)
        self._streams: dict[str, _Stream] = {}  # loop thread only
        self._stopping = False
        self._draining = False
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
        self.dead: BaseException | None = None

    # --- lifecycle (any thread) ------------------------------------------------------------------

    def start(self) -> None:
        # NOTE on the GIL: the engine thread releases the GIL inside every torch op and takes it back dozens
        # of times a step; with CPython's default 5 ms switch interval each retake can wait up to 5 ms behind a
        # thread parsing or validating a request in Python, so one client's heavy (even refused) requests
        # would become every stream's inter-token latency. A 0.5 ms interval bounds that wait.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self.release_pool()  # the loading thread's OpenMP workers would throttle the loop thread's (openmp_env)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is left and end the loop thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def drain(self) -> None:
        """Stop accepting requests (in-flight ones go on); called when a shutdown signal arrives."""
        with self._cv:
            self._draining = True

    def abort_all(self) -> None:
        """End every in-flight request now (finish reason ``abort``): the end of a shutdown grace period."""
        with self._cv:
            self._inbox.append(("abort_all", None))
            self._cv.notify()

    @property
    def accepting(self) -> bool:
        return not (self._draining or self._stopping) and self.dead is None

    # --- the asyncio side ---------------------------------------------------------------------------

    async def add(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                  **options: Any) -> RequestHandle:
        """Queue a request; return once the engine has taken it (by the next step).

        ``options`` go to ``Engine.add_request`` as they are (``cache_salt``, ``priority``).

        Raises :class:`QueueFull` or :class:`ShuttingDown` at once, ``RequestRejected`` if the engine
        refuses it. Iterate the handle for its outputs; :meth:`RequestHandle.close` (always call it,
        in a ``finally``) aborts the request if it has not finished: a client that went away or a
        cancelled task gives its blocks back at once.
        """
        loop = asyncio.get_running_loop()
        stream = _Stream(request_id, loop, accepted=loop.create_future())
        with self._cv:
            if not self.accepting:
                raise ShuttingDown("the server is shutting down")
            evicting = self._pending_adds + self._waiting + params.n > self.max_waiting
            if evicting and not self._may_evict(options.get("priority", 0)):
                raise QueueFull(f"the waiting queue is full ({self.max_waiting} sequences); retry later")
            self._pending_adds += params.n
            self._inbox.append(("add", (stream, prompt, params, options, evicting)))
            self._cv.notify()
        handle = RequestHandle(self, stream)
        try:
            await stream.accepted
        except BaseException:
            handle.close()  # cancelled while queued: the add may still go through, so abort it too
            raise
        return handle

    def has_room(self, sequences: int, priority: int = 0) -> bool:
        """Whether ``sequences`` more would fit in the waiting queue now (a whole request is admitted or not),
        or might by evicting worse-priority requests (decided when the add is taken)."""
        with self._cv:
            fits = self._pending_adds + self._waiting + sequences <= self.max_waiting
            return fits or self._may_evict(priority)

    def _may_evict(self, priority: int) -> bool:
        """(under ``_cv``) Whether some waiting request might be evicted for a newcomer of ``priority``."""
        return self._evicts and self._worst_waiting is not None and priority < self._worst_waiting

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._inbox.append(("abort", request_id))
            self._cv.notify()

    # --- the loop thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug in the loop itself: fail loudly, /health turns 503
            log.exception("the engine loop died")
            self.dead = exc
            self._end_all(partial(RequestFailed, f"the engine loop died: {type(exc).__name__}: {exc}"))

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not self._inbox and not self._stopping and not engine.has_unfinished():
                    self._cv.wait()
                inbox, self._inbox = self._inbox, []
                stopping = self._stopping
            self._take(inbox)
            if stopping:
                self._end_all(partial(RequestFailed, "the server stopped"))
                return
            if not engine.has_unfinished():
                self._observe()  # aborts may have emptied the engine: the gauges must show it
                continue
            try:
                if self.between_steps is not None:
                    self.between_steps()
                outputs = engine.step(stream=True)
            except Exception as exc:  # noqa: BLE001 - a failed step must not end the server
                log.exception("engine step failed; ending the requests in flight")
                message = f"the engine step failed: {type(exc).__name__}: {exc}"
                self._end_all(partial(RequestFailed, message))
                continue
            self.steps += 1
            self._deliver(outputs)
            self._count_waiting()
            self._observe()

    def _observe(self) -> None:
        if self.on_step is not None:
            try:
                self.on_step(self.engine)
            except Exception:  # noqa: BLE001 - metrics must never stop serving
                log.exception("metrics update failed")

    def _take(self, inbox: list[tuple[str, Any]]) -> None:
        for kind, payload in inbox:
            if kind == "add":
                self._take_add(*payload)
            elif kind == "abort":
                if self._streams.pop(payload, None) is not None:
                    self.engine.abort(payload)
            else:  # abort_all: give every stream a last output with finish reason "abort"
                for request_id in list(self._streams):
                    self._abort_cleanly(request_id)
        self._count_waiting()

    def _count_waiting(self) -> None:
        waiting = self.engine.scheduler.waiting
        worst = max((seq.priority for seq in waiting), default=None) if self._evicts else None
        with self._cv:
            self._waiting = len(waiting)
            self._worst_waiting = worst

    def _take_add(self, stream: _Stream, prompt: Any, params: SamplingParams, options: dict[str, Any],
                  evicting: bool) -> None:
        """An add from the inbox; one that found the queue full evicts worse-priority requests once it is in,
        or is refused (evicting nobody) if that cannot make room."""
        with self._cv:
            self._pending_adds -= params.n
        priority = options.get("priority", 0)
        victims = self._victims(params.n, priority) if evicting else []
        if victims is None:
            full = QueueFull(f"the waiting queue is full ({self.max_waiting} sequences); retry later")
            stream.loop.call_soon_threadsafe(_resolve, stream.accepted, full)
        elif self._add(stream, prompt, params, options):
            self._evict(victims, priority)

    def _victims(self, sequences: int, priority: int) -> list[str] | None:
        """The waiting requests to evict so that ``sequences`` more fit ([] if they fit), or None if no choice of
        requests worse than ``priority`` makes room."""
        with self._cv:
            excess = self._pending_adds + len(self.engine.scheduler.waiting) + sequences - self.max_waiting
        victims: list[str] = []
        for request_id, count in self.engine.evictable(priority) if excess > 0 else ():
            victims.append(request_id)
            excess -= count
            if excess <= 0:
                break
        return None if excess > 0 else victims

    def _evict(self, victims: list[str], priority: int) -> None:
        for request_id in victims:
            stream = self._streams.pop(request_id, None)
            self.engine.abort(request_id)
            if stream is not None:
                message = (f"the waiting queue is full ({self.max_waiting} sequences) and a request of a better "
                           "priority took this one's place; retry later")
                stream.loop.call_soon_threadsafe(stream.mailbox.end, Evicted(message))
            log.info("evicted waiting request %s for one of priority %d", request_id, priority)

    def _add(self, stream: _Stream, prompt: Any, params: SamplingParams, options: dict[str, Any]) -> bool:
        try:
            self.engine.add_request(prompt, params, request_id=stream.request_id, **options)
        except Exception as exc:  # noqa: BLE001 - RequestRejected, or a tokenizer failure: this request only
            error = exc if isinstance(exc, RequestRejected) else RequestRejected(f"{type(exc).__name__}: {exc}")
            stream.loop.call_soon_threadsafe(_resolve, stream.accepted, error)
            return False
        self._streams[stream.request_id] = stream
        stream.loop.call_soon_threadsafe(_resolve, stream.accepted, None)
        return True

    def _abort_cleanly(self, request_id: str) -> None:
        stream = self._streams.pop(request_id)
        self.engine.abort(request_id)
        stream.loop.call_soon_threadsafe(stream.mailbox.end, Aborted("the server is stopping"))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Any]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            if out.finished:
                del self._streams[out.request_id]
            batches.setdefault(stream.loop, []).append((stream, out))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(self._hand_over, batch)

    def _hand_over(self, batch: list[tuple[_Stream, Any]]) -> None:
        """(On the asyncio loop) each output to its mailbox; a request whose reader stalled is aborted instead."""
        now = time.monotonic()
        for stream, out in batch:
            if out.finished or not stream.mailbox.stalled(now, self.stall_timeout):
                stream.mailbox.put(out, now)
                continue
            log.warning("aborting request %s: its reader took no output for %.3g s (--stream-stall-timeout)",
                        stream.request_id, self.stall_timeout)
            stream.mailbox.end(StreamStalled(f"the reader took no output for {self.stall_timeout:g} s"),
                               drop_unread=True)
            self.abort(stream.request_id)

    def _end_all(self, error: Callable[[], BaseException]) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            stream.loop.call_soon_threadsafe(stream.mailbox.end, error())
        self._streams.clear()


class RequestHandle:
    """One request's outputs, in order: cumulative :class:`RequestOutput` s, the last one ``finished``."""

    def __init__(self, owner: AsyncEngine, stream: _Stream) -> None:
        self._owner = owner
        self._stream = stream
        self.request_id = stream.request_id
        self.finished = False

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._stream.mailbox.get()
        except Exception:  # the request's end (a cancelled reader is not: close() must still abort it)
            self.finished = True
            raise
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        """Abort the request unless it has finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)

