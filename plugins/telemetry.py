"""The telemetry plugin: the engine's block allocator and requests, published live.

Switched on by ``EngineConfig(telemetry="unix:PATH" | "tcp:127.0.0.1:PORT")``
and/or ``EngineConfig(trace="FILE")``. Each engine gets its own
:class:`Telemetry` object. Per step it turns the core's events into one
``delta`` line (see :mod:`pagedkv.core.telemetry_protocol`); every
``keyframe_steps`` steps or ``keyframe_s`` seconds it adds a ``snapshot``
read from the engine's real pool and scheduler, the source of truth, through
their public read-only view (``engine.kv_view()``, :class:`pagedkv.core.kv.kv_view.KVCacheView`).

Options (``EngineConfig.plugin_options["telemetry"]``): ``keyframe_steps`` (50),
``keyframe_s`` (1.0), ``heartbeat_s`` (1.0), ``queue_lines`` (1024) and
``queue_bytes`` (32 MiB) per client, ``socket_sndbuf`` (the kernel's default), ``max_clients`` (16).
"""

from __future__ import annotations

import atexit
import time
import weakref
from typing import Any

from pagedkv.core.hookspecs import hookimpl
from pagedkv.core.output_files import OutputFile
from pagedkv.core.telemetry_protocol import encode, message
from pagedkv.plugins.telemetry_address import parse_address


@hookimpl
def pagedkv_configure(config: Any, pm: Any) -> None:
    if getattr(config, "telemetry", None) or getattr(config, "trace", None):
        pm.register(Telemetry(config))


_LIVE: weakref.WeakSet[Telemetry] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At exit (also after Ctrl-C or SIGTERM mid-step): every open trace still gets its ``end`` record."""
    for telemetry in list(_LIVE):
        try:
            telemetry.close()
        except Exception:  # noqa: BLE001 - a state left mid-step must not turn exit into a traceback
            if telemetry.trace is not None:
                telemetry.trace.close()


def find(engine: Any) -> Telemetry | None:
    """The engine's telemetry object, if it has one."""
    for plugin in engine.pm.get_plugins():
        if isinstance(plugin, Telemetry):
            return plugin
    return None


def close(engine: Any) -> None:
    """Write the final snapshot and an ``end`` line, stop the server, close the trace."""
    telemetry = find(engine)
    if telemetry is not None:
        telemetry.close()


class Telemetry:
    def __init__(self, config: Any) -> None:
        self.config = config
        self.address = parse_address(config.telemetry) if config.telemetry else None  # refuse bad ones first
        self.trace_file = OutputFile(config.trace, "trace") if config.trace else None  # checked, not yet written
        opts = dict(getattr(config, "plugin_options", {}).get("telemetry", {}))
        self.keyframe_steps = int(opts.get("keyframe_steps", 50))
        self.keyframe_s = float(opts.get("keyframe_s", 1.0))
        self.heartbeat_s = float(opts.get("heartbeat_s", 1.0))
        self.queue_lines = int(opts.get("queue_lines", 1024))
        self.queue_bytes = int(opts.get("queue_bytes", 32 << 20))
        self.socket_sndbuf = opts.get("socket_sndbuf")
        self.max_clients = int(opts.get("max_clients", 16))
        self.engine: Any = None
        self.view: Any = None  # the engine's KVCacheView
        self.server: Any = None
        self.trace: Any = None
        self.seq = 0
        self.step = 0
        self.closed = False
        self._t0 = 0.0  # the clock's reading at start (set when the engine starts)
        self._hello: bytes = b""
        self._keyframe: bytes = b""
        self._backlog: list[bytes] = []  # deltas since the keyframe
        self._keyframe_at = (0, 0.0)  # (step, time) of the newest keyframe
        self._counters = {"cow": 0, "swap_out": 0, "swap_in": 0, "evicted": 0}  # blocks, from events
        self._last_step_t = self._t0
        self._lock: Any = None
        self._clock: Any = time.monotonic

    # --- hooks -------------------------------------------------------------------------------------

    @hookimpl
    def pagedkv_engine_started(self, engine: Any) -> None:
        import threading

        self.engine = engine
        self.view = engine.kv_view()
        self._clock = engine.clock  # wall time, or a simulator's simulated seconds
        self._t0 = self._last_step_t = self._clock()
        self._lock = threading.Lock()
        self._hello = encode(self._hello_message())
        self._keyframe = encode(self._snapshot_message())
        self._keyframe_at = (self.step, self._clock())
        if self.trace_file is not None:
            self.trace = self.trace_file.open()  # a temporary file: the user's file is replaced only once we run
            self.trace.write(self._hello + self._keyframe)
            self.trace.flush()
        if self.address is not None:
            try:
                self.server = self._start_server()
            except BaseException:
                if self.trace_file is not None:
                    self.trace_file.discard()
                    self.trace = None
                raise
            self._lock = self.server.lock
        if self.trace_file is not None:
            self.trace_file.commit()
        _LIVE.add(self)

    def _start_server(self) -> Any:
        from pagedkv.plugins.telemetry_server import TelemetryServer

        return TelemetryServer(
            self.address,
            greeting=lambda: [self._hello, self._keyframe, *self._backlog],
            resync=lambda: [self._keyframe, *self._backlog],
            heartbeat=lambda: encode(message("heartbeat", self.seq, self._now(), step=self.step)),
            max_lines=self.queue_lines,
            max_bytes=self.queue_bytes,
            heartbeat_s=self.heartbeat_s,
            sndbuf=self.socket_sndbuf,
            max_clients=self.max_clients,
        )

    @hookimpl
    def pagedkv_on_step_events(self, events: list[Any]) -> None:
        if self.engine is None or self.closed:
            return
        encoded = []
        for ev in events:
            self._count(ev.kind, ev.data)
            encoded.append([ev.kind, ev.data])
        now = self._clock()
        stats = self._stats(now)
        stats["step_ms"] = round((now - self._last_step_t) * 1000.0, 2)
        self._last_step_t = now
        with self._lock:
            self.seq += 1
            self.step += 1
            delta = encode(
                message(
                    "delta", self.seq, self._now(now), step=self.step, events=encoded, stats=stats,
                    progress=self._progress(),
                )
            )
            lines = [delta]
            kf_step, kf_time = self._keyframe_at
            if self.step - kf_step >= self.keyframe_steps or now - kf_time >= self.keyframe_s:
                self._keyframe = encode(self._snapshot_message(now))
                self._keyframe_at = (self.step, now)
                self._backlog = []
                lines.append(self._keyframe)
            else:
                self._backlog.append(delta)
            if self.server is not None:
                self.server.broadcast(lines)
        if self.trace is not None:
            self.trace.write(b"".join(lines))
            self.trace.flush()

    # --- shutting down -----------------------------------------------------------------------------

    def close(self) -> None:
        if self.closed or self.engine is None:
            return
        self.closed = True
        with self._lock:
            self.seq += 1  # the final snapshot also covers events not flushed by a step (e.g. an abort)
            self._keyframe = encode(self._snapshot_message())
            self._backlog = []
            end = encode(message("end", self.seq, self._now(), step=self.step))
            lines = [self._keyframe, end]
            if self.server is not None:
                self.server.broadcast(lines)
        if self.trace is not None:
            self.trace.write(b"".join(lines))
            self.trace.close()
            self.trace = None
        if self.server is not None:
            self.server.close()
        _LIVE.discard(self)

    # --- messages ----------------------------------------------------------------------------------

    def _now(self, now: float | None = None) -> float:
        return (now if now is not None else self._clock()) - self._t0

    def _hello_message(self) -> dict:
        engine, config = self.engine, self.config
        name = getattr(getattr(engine.model, "config", None), "_name_or_path", None)
        model = config.model or name or (type(engine.model).__name__ if engine.model is not None else "simulated")
        return message(
            "hello", self.seq, self._now(), num_blocks=self.view.num_blocks, block_size=config.block_size,
            num_cpu_blocks=self.view.num_cpu_blocks, backend=config.backend, model=str(model),
            device=str(config.device), wall=time.time(),
        )

    def _snapshot_message(self, now: float | None = None) -> dict:
        view = self.view
        requests = []
        for rid, seqs in view.requests().items():
            first = seqs[0]
            requests.append({
                "id": rid,
                "state": first.status.value,
                "prompt": len(first.prompt_token_ids),
                "gen": max(len(s.output_token_ids) for s in seqs),
                "computed": first.num_computed_tokens,
                "blocks": list(dict.fromkeys(b for s in seqs for b in s.block_table.blocks)),
                "cpu_blocks": [b for s in seqs for b in view.cpu_blocks(s)],
                "preemptions": sum(s.num_preemptions for s in seqs),
                "samples": view.num_samples(seqs),
            })
        return message(
            "snapshot", self.seq, self._now(now), step=self.step, num_blocks=view.num_blocks,
            block_size=self.config.block_size, refs=view.ref_counts(), kept=sorted(view.cached_blocks()),
            requests=requests, stats=self._stats(now if now is not None else self._clock()),
        )

    def _stats(self, now: float) -> dict:
        view, stats = self.view, self.engine.stats
        held = view.computed_tokens()
        used = view.num_used
        slots = used * self.config.block_size
        return {
            "running": view.num_running,
            "waiting": view.num_waiting,
            "swapped": view.num_swapped,
            "used": used,
            "cached": view.num_cached,
            "free": view.num_free,
            "kv_usage": round(100.0 * used / view.num_blocks, 2),
            "waste": round(max(0.0, 100.0 * (1.0 - held / slots)) if slots else 0.0, 2),
            "generated": stats.generated_tokens,
            "prompt_tokens": stats.prompt_tokens,
            "preemptions": stats.preemptions,
            "finished": stats.finished,
            **self._counters,
            **self._plugin_stats(),
        }

    def _plugin_stats(self) -> dict:
        """What other plugins report (prefix hit rate, CoW copies, swaps), when they are there."""
        hook = getattr(self.engine.pm.hook, "pagedkv_report_stats", None)
        if hook is None:
            return {}
        merged: dict = {}
        try:
            for answer in hook():
                if isinstance(answer, dict):
                    merged.update({k: v for k, v in answer.items() if isinstance(v, (int, float, str))})
        except Exception:  # noqa: BLE001 - a broken counter must not stop telemetry
            return {}
        return merged

    def _progress(self) -> dict:
        return {s.request_id: [s.num_computed_tokens, len(s.output_token_ids)] for s in self.view.running()}

    def _count(self, kind: str, data: dict) -> None:
        c = self._counters
        if kind == "block_cow":
            c["cow"] += 1
        elif kind == "block_swap_out":
            c["swap_out"] += 1
        elif kind == "block_swap_in":
            c["swap_in"] += 1
        elif kind == "block_evict":
            c["evicted"] += 1


# --- reading the engine (also used by tests to compare with a monitor's state) ------------------------


def engine_cpu_map(engine: Any) -> dict[int, str]:
    """CPU swap block -> the request whose KV it holds."""
    view = engine.kv_view()
    return {b: rid for rid, seqs in view.requests().items() for seq in seqs for b in view.cpu_blocks(seq)}


def engine_block_map(engine: Any) -> list[tuple[str, int, tuple[str, ...]]]:
    """Every GPU block as ``(state, refs, sorted holders)``: the form ``MonitorState.block_map()`` gives."""
    view = engine.kv_view()
    holders: list[list[str]] = [[] for _ in range(view.num_blocks)]
    for rid, seqs in view.requests().items():
        for seq in seqs:
            for b in seq.block_table:
                holders[b].append(rid)
    cached = set(view.cached_blocks())
    out = []
    for b, refs in enumerate(view.ref_counts()):
        if refs == 0:
            out.append(("cached" if b in cached else "free", 0, ()))
        else:
            out.append(("shared" if refs > 1 else "used", refs, tuple(sorted(holders[b]))))
    return out


def engine_request_tables(engine: Any) -> dict[str, list[int]]:
    """Each live request's GPU blocks in block-table order (samples of one request: each block once)."""
    return {
        rid: list(dict.fromkeys(b for s in seqs for b in s.block_table))
        for rid, seqs in engine.kv_view().requests().items()
    }
