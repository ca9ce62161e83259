"""One request's outputs waiting for their reader: the latest snapshot only, and how long it has waited.

The engine's outputs are cumulative snapshots (every token so far, each sample's), so a reader
that falls behind loses nothing when an unread snapshot is replaced by the next one (vLLM's
``RequestOutputCollector`` does the same). A queue of every snapshot would grow as
O(steps x tokens x samples) behind a client that stopped reading: ``n=64`` x 1,500 tokens
queued ~900 MiB before the send deadline cut the connection. Here a request holds at most
one snapshot, and ``waiting_since`` says how long the reader has left it unread, so the
owner can end a request nobody reads instead of computing tokens
nobody takes, with its KV blocks held.
"""

from __future__ import annotations

import asyncio
from typing import Any


class Mailbox:
    """The newest unread output of one request and, once it has one, its end (an exception to raise).

    Used on the asyncio loop only. An unread output is kept until it is read even after the end
    arrives (a request aborted at shutdown still hands its last text to a reader that is there).
    """

    def __init__(self) -> None:
        self._latest: Any = None
        self._end: BaseException | None = None
        self._ready = asyncio.Event()
        self.waiting_since: float | None = None  # when the unread output first arrived (None: nothing unread)

    def put(self, output: Any, now: float) -> None:
        """Hand over ``output``, replacing an unread older snapshot (ignored once the end has come)."""
        if self._end is not None:
            return  # a step that ran before the abort took effect
        if self._latest is None:
            self.waiting_since = now
        self._latest = output
        self._ready.set()

    def end(self, error: BaseException, drop_unread: bool = False) -> None:
        """No output comes after this one: ``get`` raises ``error`` once the unread output (if kept) is read."""
        if self._end is None:
            self._end = error
        if drop_unread:
            self._latest, self.waiting_since = None, None
        self._ready.set()

    def stalled(self, now: float, timeout: float | None) -> bool:
        """Whether an output has waited unread for more than ``timeout`` seconds."""
        return timeout is not None and self.waiting_since is not None and now - self.waiting_since > timeout

    async def get(self) -> Any:
        """The newest unread output, or the end's exception (raised); waits for one of them."""
        while self._latest is None and self._end is None:
            self._ready.clear()
            await self._ready.wait()
        if self._latest is not None:
            output, self._latest, self.waiting_since = self._latest, None, None
            return output
        raise self._end
