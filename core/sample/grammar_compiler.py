"""Compiling constraints off the step loop, once per distinct constraint.

One worker thread builds the grammar backend (its import and tokenizer preparation) on first use and
then compiles each constraint it is handed; equal constraints share one future, so a hundred requests
with the same schema compile it once. The server calls :meth:`GrammarCompiler.check` from its request
handler (through a thread) to answer a 400 before queueing; the engine calls :meth:`submit` and parks
the request until the future is done (see ``grammar_gate``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from pagedkv.core.errors import RequestRejected
from pagedkv.core.sample.grammar_backend import CompiledGrammar, GrammarBackend, GrammarError
from pagedkv.core.sample.structured_output import StructuredOutputs

CACHE_SIZE = 256  # compiled constraints kept (least recently used go first)


class GrammarCompiler:
    """``make_backend()`` builds the backend (called once, on the worker thread)."""

    def __init__(self, make_backend: Callable[[], GrammarBackend], cache_size: int = CACHE_SIZE) -> None:
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._backend_error: Exception | None = None
        self._cache: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.compiled = 0  # constraints compiled (cache misses)

    @property
    def backend(self) -> GrammarBackend | None:
        """The backend, once the first compile built it."""
        return self._backend

    def submit(self, constraint: StructuredOutputs) -> Future[CompiledGrammar]:
        """A future of the compiled grammar (done at once when this constraint was compiled before)."""
        key = constraint.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedkv-grammar")
            future = self._pool.submit(self._compile, constraint)
            self._cache[key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def check(self, constraint: StructuredOutputs) -> CompiledGrammar:
        """Compile now (blocking; for a caller that is not the step loop); raises :class:`RequestRejected`."""
        return result_of(self.submit(constraint))

    def _compile(self, constraint: StructuredOutputs) -> CompiledGrammar:
        backend = self._ensure_backend()
        self.compiled += 1
        return backend.compile(constraint)

    def _ensure_backend(self) -> GrammarBackend:
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
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


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
