"""Compiling constraints off the step loop, once per distinct constraint, bounded and fair.

A few worker threads (see ``compile_queue``: per-client turns, no client holding every worker) build the
grammar backend on first use and then compile each constraint they are handed; equal constraints share one
future, so a hundred requests with the same schema compile it once. Every compile is bounded: a constraint
over ``max_bytes`` (its canonical text) is refused before any work, and one still running after
``timeout_s`` fails (its request answers 400; the native compile cannot be stopped, so it finishes in the
background and its result is dropped). The cache of compiled grammars is bounded by estimated bytes as
well as by count (a grammar bigger than the whole byte budget is not kept at all); what it evicts is freed once
no live request holds a matcher of it.

The server calls :meth:`GrammarCompiler.check` from its request handler (through a thread) to answer a 400
before queueing; the engine calls :meth:`submit` and parks the request until the future is done (see
``grammar_gate``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError

from pagedkv.core.errors import RequestRejected
from pagedkv.core.sample.compile_queue import FairCompileQueue
from pagedkv.core.sample.grammar_backend import CompiledGrammar, GrammarBackend, GrammarError
from pagedkv.core.sample.structured_output import StructuredOutputs

CACHE_SIZE = 256  # compiled constraints kept at most (least recently used go first)
# their estimated memory at most. vLLM's xgrammar cache keeps 512 MiB; 32 MiB here, because what the cache holds
# stays in the server's RSS and issue 42's goal is within 10% of an idle ~330 MiB server after any client's
# grammars (a 100 KB literal is ~40 MiB compiled; common schemas of 1-5 KB estimate 0.8-3 MiB: ~10-40 kept)
CACHE_BYTES = 32 * 2**20
COMPILE_WORKERS = 2
COMPILE_TIMEOUT_S = 10.0
MAX_GRAMMAR_BYTES = 128 * 1024
# A grammar's memory when its backend does not say (``CompiledGrammar.nbytes``): llguidance measured
# (benchmarks/JOURNAL.md, issue 42) at ~400-530 bytes of RSS per byte of grammar text after 20 masks for long
# literals, the worst case (a 100 KB literal holds ~40 MiB, estimated 49); an upper bound for the rest (JSON
# schemas, choices and regexes hold 4-13x less than estimated), plus a small fixed part
BASE_BYTES = 256 * 1024
BYTES_PER_GRAMMAR_BYTE = 512


def estimated_bytes(grammar: CompiledGrammar, key: str) -> int:
    """The backend's own figure if it has one, else the measured per-byte estimate."""
    nbytes = getattr(grammar, "nbytes", None)
    return int(nbytes) if isinstance(nbytes, int) else BASE_BYTES + BYTES_PER_GRAMMAR_BYTE * len(key)


class GrammarCompiler:
    """``make_backend()`` builds the backend (called once, on a worker thread)."""

    def __init__(self, make_backend: Callable[[], GrammarBackend], cache_size: int = CACHE_SIZE,
                 cache_bytes: int = CACHE_BYTES, workers: int = COMPILE_WORKERS,
                 timeout_s: float = COMPILE_TIMEOUT_S, max_bytes: int = MAX_GRAMMAR_BYTES) -> None:
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._backend_error: Exception | None = None
        self._backend_lock = threading.Lock()
        self._cache: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self._sizes: dict[str, int] = {}  # key -> estimated bytes, for the done ones still cached
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self._timeout_s = timeout_s
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._queue = FairCompileQueue(workers)
        self.compiled = 0  # constraints compiled (cache misses)
        self.timed_out = 0  # compiles that ran past the time limit
        self.cached_bytes = 0  # estimated bytes of the cached grammars

    @property
    def backend(self) -> GrammarBackend | None:
        """The backend, once the first compile built it."""
        return self._backend

    def __len__(self) -> int:
        return len(self._cache)

    def submit(self, constraint: StructuredOutputs, client: str = "") -> Future[CompiledGrammar]:
        """A future of the compiled grammar (done at once when this constraint was compiled before, or is
        refused for its size); ``client`` names who asked, for fair turns between clients."""
        key = constraint.key()
        if len(key) > self._max_bytes:
            refused: Future[CompiledGrammar] = Future()
            refused.set_exception(GrammarError(f"the constraint is {len(key):,} bytes; this server compiles at most "
                                               f"{self._max_bytes:,} (--max-grammar-bytes)"))
            return refused
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = Future()
            self._cache[key] = future
            self._evict()
        self._queue.submit(client, lambda: self._run(constraint, key, future))
        return future

    def compiling(self, client: str) -> int:
        """Compiles of ``client`` running now."""
        return self._queue.active(client)

    def check(self, constraint: StructuredOutputs, client: str = "") -> CompiledGrammar:
        """Compile now (blocking; for a caller that is not the step loop); raises :class:`RequestRejected`."""
        return result_of(self.submit(constraint, client))

    def _run(self, constraint: StructuredOutputs, key: str, future: Future[CompiledGrammar]) -> None:
        """One compile on a worker, its future failed by a timer if it runs past the limit."""
        if not future.set_running_or_notify_cancel():
            return
        timer = threading.Timer(self._timeout_s, self._expire, (future,))
        timer.daemon = True
        timer.start()
        try:
            grammar = self._ensure_backend().compile(constraint)
        except BaseException as exc:  # noqa: BLE001 - the request's answer, whatever it is
            _settle(future, exc=exc)
            return
        finally:
            timer.cancel()
            self.compiled += 1
        if _settle(future, result=grammar):
            self._account(key, future, estimated_bytes(grammar, key))

    def _expire(self, future: Future[CompiledGrammar]) -> None:
        self.timed_out += 1  # counted before a waiter can wake on it
        if not _settle(future, exc=GrammarError(f"compiling took longer than {self._timeout_s:g} s "
                                                "(--grammar-compile-timeout)")):
            self.timed_out -= 1  # the compile got there first

    def _account(self, key: str, future: Future[CompiledGrammar], nbytes: int) -> None:
        with self._lock:
            if self._cache.get(key) is not future:  # evicted while compiling: the waiters hold it, nobody else
                return
            if nbytes > self._cache_bytes:  # bigger than the whole budget: its waiters have it, the cache does not
                del self._cache[key]
                return
            self._sizes[key] = nbytes
            self.cached_bytes += nbytes
            self._evict()

    def _evict(self) -> None:
        """Least recently used first, until within both bounds (the newest entry always stays)."""
        while len(self._cache) > 1 and (len(self._cache) > self._cache_size or self.cached_bytes > self._cache_bytes):
            key, _ = self._cache.popitem(last=False)
            self.cached_bytes -= self._sizes.pop(key, 0)

    def _ensure_backend(self) -> GrammarBackend:
        with self._backend_lock:  # several workers: one builds it, the others wait for it
            if self._backend_error is not None:
                raise self._backend_error
            if self._backend is None:
                try:
                    self._backend = self._make_backend()
                except Exception as exc:
                    self._backend_error = exc
                    raise
            return self._backend

    def close(self) -> None:
        self._queue.close()
        with self._lock:
            for future in self._cache.values():
                future.cancel()  # the queued ones (a running compile finishes in the background)


def _settle(future: Future[CompiledGrammar], result: CompiledGrammar | None = None,
            exc: BaseException | None = None) -> bool:
    """Set ``future`` unless the timer (or the compile) got there first; True if this call set it."""
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)  # type: ignore[arg-type]
    except InvalidStateError:
        return False
    return True


def result_of(future: Future[CompiledGrammar]) -> CompiledGrammar:
    """A done (or awaited) compile's grammar; a failed one as :class:`RequestRejected` with its reason."""
    try:
        return future.result()
    except RequestRejected:
        raise
    except GrammarError as exc:
        raise RequestRejected(f"structured_outputs cannot be compiled: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - a backend bug or a missing package: still this request's answer
        raise RequestRejected(f"structured_outputs: the grammar backend failed: {type(exc).__name__}: {exc}") from exc
