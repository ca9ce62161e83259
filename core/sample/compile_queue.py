"""A few compile worker threads shared fairly between clients.

One client's slow grammars must not queue everyone else's cheap ones: each client has its own queue, the
workers take from the clients in turn, and no client holds more than ``workers - 1`` of them at once (all
of them when there is one worker), so with two or more workers another client's job always finds one free
or soon free. A job cannot be interrupted once running (a compile is native code), so a client's share is
counted until its job really returns, time limit or not.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable

Job = Callable[[], None]


class FairCompileQueue:
    def __init__(self, workers: int, name: str = "pagedkv-grammar") -> None:
        if workers < 1:
            raise ValueError(f"grammar compile workers must be at least 1, got {workers}")
        self.workers = workers
        self.per_client = max(1, workers - 1)
        self._name = name
        self._queues: OrderedDict[str, deque[Job]] = OrderedDict()  # clients with jobs, in turn order
        self._active: dict[str, int] = {}  # client -> its jobs running now
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def submit(self, client: str, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the grammar compiler is closed")
            self._queues.setdefault(client, deque()).append(job)
            if len(self._threads) < self.workers:  # started on demand: an engine without constraints has none
                thread = threading.Thread(target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
            self._cond.notify()

    def active(self, client: str) -> int:
        """Jobs of ``client`` running now."""
        with self._cond:
            return self._active.get(client, 0)

    def _take(self) -> tuple[str, Job] | None:
        """The next client in turn with room under its share; it moves to the back of the turn order."""
        for client, queue in self._queues.items():
            if self._active.get(client, 0) < self.per_client:
                job = queue.popleft()
                del self._queues[client]
                if queue:
                    self._queues[client] = queue
                self._active[client] = self._active.get(client, 0) + 1
                return client, job
        return None

    def _work(self) -> None:
        while True:
            with self._cond:
                taken = self._take()
                while taken is None:
                    if self._closed:
                        return
                    self._cond.wait()
                    taken = self._take()
            client, job = taken
            del taken
            try:
                job()
            finally:
                del job  # an idle worker must not keep the last job (and the grammar its future holds) alive
                with self._cond:
                    self._active[client] -= 1
                    if not self._active[client]:
                        del self._active[client]
                    self._cond.notify_all()

    def close(self) -> list[Job]:
        """Let the workers end (a running job finishes first, in the background); the queued jobs, dropped."""
        with self._cond:
            self._closed = True
            dropped = [job for queue in self._queues.values() for job in queue]
            self._queues.clear()
            self._cond.notify_all()
        return dropped
