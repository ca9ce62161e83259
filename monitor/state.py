"""The monitor's state reducer: telemetry messages in, block map and request table out.

Plain Python (no Textual), so it is tested without a UI and could drive any
front end. Deltas are applied only in order; a gap in ``seq`` (a dropped or
lost line) marks the state out of sync until the next snapshot, which replaces
everything. Event kinds this reducer does not know are counted and skipped.
A ``hello`` from a different engine run (see :func:`hello_run_id`) starts the state over: blocks,
requests, colours, stats, rates and history; the same run's hello again (a reconnect) keeps them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pagedkv.core.telemetry_protocol import ProtocolError
from pagedkv.monitor.delta_events import HANDLERS, DeltaEvents

FREE, USED, SHARED, CACHED = "free", "used", "shared", "cached"
HISTORY = 120  # points kept for the sparklines
MAX_FINISHED = 500  # finished requests kept in the table


@dataclass
class RequestInfo:
    id: str
    color: int  # a stable index into the monitor's palette, in order of first sight
    state: str = "waiting"
    prompt: int = 0
    generated: int = 0
    computed: int = 0
    blocks: list[int] = field(default_factory=list)  # GPU block table, logical order
    cpu_blocks: list[int] = field(default_factory=list)
    preemptions: int = 0
    finish_reason: str | None = None
    samples: int = 1  # sequences still live (n > 1 requests finish one sample at a time)
    finished_generated: int = 0  # tokens of the samples that have finished, summed
    finished_order: int = 0  # when it finished, among this run's requests (the table lists the newest first)


def hello_run_id(msg: dict) -> tuple:
    """What tells one engine run from another: its start time (``wall``, in every hello since protocol 1)
    and what it serves. A reconnect to the same run gets the same hello, sent again."""
    return tuple(msg.get(k) for k in ("wall", "backend", "model", "device", "num_blocks", "block_size",
                                      "num_cpu_blocks"))


class MonitorState(DeltaEvents):
    def __init__(self) -> None:
        self.messages = 0
        self.runs = 0  # runs seen: a hello from a different engine run resets everything else
        self.run_id: tuple | None = None
        self.requests: dict[str, RequestInfo] = {}
        self._reset()

    def _reset(self) -> None:
        """Forget the previous run: blocks, requests, stats, rates and history (the table drops its rows)."""
        gone = set(self.requests)
        self.num_blocks = 0
        self.block_size = 0
        self.num_cpu_blocks = 0
        self.backend = "?"
        self.model = "?"
        self.device = "?"
        self.seq: int | None = None
        self.step = 0
        self.t = 0.0
        self.synced = False
        self.ended = False
        self.gaps = 0  # times a missing delta was detected
        self.resyncs = 0  # snapshots that found the state out of sync
        self.unknown_events: dict[str, int] = {}
        self.refs: list[int] = []
        self.kept: set[int] = set()
        self.holders: list[list[str]] = []
        self.cpu_holders: dict[int, str] = {}
        self.requests: dict[str, RequestInfo] = {}
        self.stats: dict[str, Any] = {}
        self.history: dict[str, deque[float]] = {k: deque(maxlen=HISTORY) for k in ("kv_usage", "waste", "tok_s")}
        self._rate_window: deque[tuple[float, int]] = deque()
        self.peak_tok_s = 0.0  # this run's highest tokens/s: the rate sparkline's scale only grows
        self._colors = 0
        self.finished_requests = 0  # requests (not samples) seen finishing in this run
        self.joined_late = False  # the first keyframe already counted finished samples: the count above is short
        self._first_keyframe = True
        self.dirty: set[int] = set()
        self.dirty_cpu: set[int] = set()
        self.dirty_requests: set[str] = gone
        self.all_dirty = True

    # --- reading ----------------------------------------------------------------------------------

    def block_state(self, block: int) -> str:
        refs = self.refs[block]
        if refs == 0:
            return CACHED if block in self.kept else FREE
        return SHARED if refs > 1 else USED

    def owner(self, block: int) -> RequestInfo | None:
        holders = self.holders[block]
        return self.requests.get(holders[0]) if holders else None

    def block_map(self) -> list[tuple[str, int, tuple[str, ...]]]:
        """Every GPU block as ``(state, refs, sorted holders)``, comparable with the engine's."""
        return [(self.block_state(b), self.refs[b], tuple(sorted(self.holders[b]))) for b in range(self.num_blocks)]

    def cpu_map(self) -> dict[int, str]:
        return dict(self.cpu_holders)

    def request_tables(self) -> dict[str, list[int]]:
        return {r.id: list(r.blocks) for r in self.requests.values() if r.state != "finished"}

    def take_dirty(self) -> tuple[bool, set[int], set[int], set[str]]:
        """What changed since the last call: (everything?, GPU blocks, CPU blocks, request ids)."""
        out = (self.all_dirty, self.dirty, self.dirty_cpu, self.dirty_requests)
        self.all_dirty, self.dirty, self.dirty_cpu, self.dirty_requests = False, set(), set(), set()
        return out

    @property
    def tokens_per_s(self) -> float:
        return self.history["tok_s"][-1] if self.history["tok_s"] else 0.0

    # --- applying messages --------------------------------------------------------------------------

    def apply(self, msg: dict[str, Any]) -> None:
        """Apply one validated message; raise :class:`ProtocolError` if it contradicts the stream."""
        self.messages += 1
        kind = msg["type"]
        if kind == "hello":
            self._hello(msg)
        elif kind == "snapshot":
            self._snapshot(msg)
        elif kind == "delta":
            self._delta(msg)
        elif kind in ("heartbeat", "end"):
            if self.synced and self.seq is not None and msg["seq"] > self.seq:
                self._lose_sync()
            self.t = max(self.t, float(msg.get("t", 0.0)))
            if kind == "end":
                self.ended = True

    def _hello(self, msg: dict) -> None:
        run_id = hello_run_id(msg)
        if self.runs == 0 or run_id != self.run_id:
            self._new_run(run_id)
        self.backend = str(msg.get("backend", "?"))
        self.model = str(msg.get("model", "?"))
        self.device = str(msg.get("device", "?"))
        self.block_size = msg["block_size"]
        self.num_cpu_blocks = msg.get("num_cpu_blocks", 0)
        self.ended = False
        self.seq, self.synced = None, False  # a new stream: its versions start again
        self._resize(msg["num_blocks"])

    def _new_run(self, run_id: tuple | None) -> None:
        if self.runs:
            self._reset()
        self.runs += 1
        self.run_id = run_id

    def _resize(self, num_blocks: int) -> None:
        if num_blocks != self.num_blocks or len(self.refs) != num_blocks:
            self.num_blocks = num_blocks
            self.refs = [0] * num_blocks
            self.kept = set()
            self.holders = [[] for _ in range(num_blocks)]
            self.synced = False
            self.all_dirty = True

    def _lose_sync(self) -> None:
        if self.synced:
            self.gaps += 1
        self.synced = False

    def _snapshot(self, msg: dict) -> None:
        refs = msg["refs"]
        if self.num_blocks and len(refs) != self.num_blocks and msg.get("num_blocks") is None:
            raise ProtocolError(f"snapshot has {len(refs)} blocks but the stream said {self.num_blocks}")
        if not self.synced and self.seq is not None:
            self.resyncs += 1
        self._resize(len(refs))
        if msg.get("block_size"):
            self.block_size = msg["block_size"]
        old_refs, old_kept, old_holders = self.refs, self.kept, self.holders
        self.refs = list(refs)
        self.kept = set(msg["kept"])
        self.holders = [[] for _ in range(self.num_blocks)]
        seen = set()
        for item in msg["requests"]:
            rid = item["id"]
            seen.add(rid)
            req = self._request(rid)
            req.state = str(item.get("state", req.state))
            req.prompt = int(item.get("prompt", req.prompt))
            req.generated = int(item.get("gen", req.generated))
            req.computed = int(item.get("computed", req.computed))
            req.preemptions = int(item.get("preemptions", req.preemptions))
            req.samples = int(item.get("samples", req.samples))
            req.blocks = list(item.get("blocks", []))
            cpu = list(item.get("cpu_blocks", []))
            if cpu or req.cpu_blocks:
                self.dirty_cpu.update(cpu, req.cpu_blocks)
                for b in req.cpu_blocks:
                    self.cpu_holders.pop(b, None)
                req.cpu_blocks = cpu
                for b in cpu:
                    self.cpu_holders[b] = rid
            for b in req.blocks:
                self.holders[b].append(rid)
            self.dirty_requests.add(rid)
        for req in self.requests.values():
            if req.id not in seen and req.state != "finished":
                self._finished(req)
                req.blocks = []
                for b in req.cpu_blocks:
                    self.cpu_holders.pop(b, None)
                    self.dirty_cpu.add(b)
                req.cpu_blocks = []
                self.dirty_requests.add(req.id)
        for b in range(self.num_blocks):
            if (old_refs[b] != self.refs[b] or (b in old_kept) != (b in self.kept)
                    or old_holders[b] != self.holders[b]):
                self.dirty.add(b)
        self.seq, self.step, self.synced = msg["seq"], msg["step"], True
        if self._first_keyframe:
            self._first_keyframe = False
            self.joined_late = bool((msg.get("stats") or {}).get("finished"))
        self._take_stats(msg)

    def _delta(self, msg: dict) -> None:
        seq = msg["seq"]
        if not self.synced or self.seq is None:
            return  # waiting for a keyframe
        if seq <= self.seq:
            return  # already applied (a keyframe's deltas sent again)
        if seq != self.seq + 1:
            self._lose_sync()
            return
        for kind, data in msg["events"]:
            handler = HANDLERS.get(kind)
            if handler is None:
                self.unknown_events[kind] = self.unknown_events.get(kind, 0) + 1
                continue
            try:
                handler(self, data)
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise ProtocolError(f"event {kind} {data!r:.80} does not fit the state: {exc!r}") from None
        for rid, progress in msg.get("progress", {}).items():
            req = self.requests.get(rid)
            if req is not None and isinstance(progress, list) and len(progress) == 2:
                if [req.computed, req.generated] != progress:
                    req.computed, req.generated = int(progress[0]), int(progress[1])
                    self.dirty_requests.add(rid)
        self.seq, self.step = seq, msg["step"]
        self._take_stats(msg)

    def _take_stats(self, msg: dict) -> None:
        stats = msg.get("stats") or {}
        self.stats = dict(stats)
        t = float(msg.get("t", self.t))
        self.t = t
        if "kv_usage" in stats:
            self.history["kv_usage"].append(float(stats["kv_usage"]))
        if "waste" in stats:
            self.history["waste"].append(float(stats["waste"]))
        if "generated" in stats:
            window = self._rate_window
            window.append((t, int(stats["generated"])))
            while len(window) > 2 and t - window[0][0] > 2.0:
                window.popleft()
            t0, g0 = window[0]
            rate = (window[-1][1] - g0) / (t - t0) if t > t0 else 0.0
            self.history["tok_s"].append(max(0.0, rate))
            self.peak_tok_s = max(self.peak_tok_s, rate)

    # --- requests (the block and request events are in delta_events.py) -------------------------

    def _request(self, rid: str) -> RequestInfo:
        req = self.requests.get(rid)
        if req is None:
            req = RequestInfo(rid, self._colors)
            self._colors += 1
            self.requests[rid] = req
            self._trim_finished()
        return req

    def _finished(self, req: RequestInfo) -> None:
        req.state = "finished"
        self.finished_requests += 1
        req.finished_order = self.finished_requests
        self.dirty_requests.add(req.id)

    def _trim_finished(self) -> None:
        if len(self.requests) <= MAX_FINISHED * 2:
            return
        done = sorted((r for r in self.requests.values() if r.state == "finished"), key=lambda r: r.finished_order)
        finished = [r.id for r in done]
        for rid in finished[: len(finished) - MAX_FINISHED]:
            del self.requests[rid]
            self.dirty_requests.add(rid)
