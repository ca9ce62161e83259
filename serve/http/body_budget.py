"""A byte budget shared by every request body being read or parsed at once (issue 42, row 10).

``--max-request-bytes`` bounds one body; nothing bounded them together: four 3.9 MB bodies of
token ids, each under the cap, were read, parsed into ~1.9 M Python ints each and validated at
once, +535 MiB. A body takes its bytes from this budget before it is read (its Content-Length,
or each chunk as it arrives) and gives them back when it has been parsed and validated; a body
that does not fit waits, within the body deadline, for others to finish (its bytes stay in the
client's socket meanwhile). One body larger than the whole budget is still admitted when it is
alone, so the budget never refuses what ``--max-request-bytes`` allows.
"""

from __future__ import annotations

import asyncio
from collections import deque


class BodyBudget:
    """``limit`` bytes of request bodies in flight, shared on one event loop."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self._waiters: deque[asyncio.Future] = deque()

    def _fits(self, size: int) -> bool:
        return self.in_flight == 0 or self.in_flight + size <= self.limit

    async def take(self, size: int) -> None:
        """Wait until ``size`` more bytes fit (or nothing else is in flight), then count them."""
        while not self._fits(size):
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self.in_flight += size

    def give(self, size: int) -> None:
        """Return ``size`` bytes taken by :meth:`take`; every waiter looks again."""
        if size <= 0:
            return
        self.in_flight -= size
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
