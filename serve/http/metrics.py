"""Prometheus metrics, named like vLLM's (``vllm:`` -> ``pagedkv:``) where they mean the same thing.

``--metrics-prefix vllm`` gives vLLM's own names (``vllm:num_requests_running``, ...; labels
``model_name`` and ``finished_reason``), so a vLLM Grafana dashboard reads them unchanged; no
``_created`` series are exported (as vLLM). Gauges and counters are set once per engine step from
the engine's own stats (:meth:`ServerMetrics.update_from_engine`, on the loop thread), which also
stamps when each request was first scheduled; the latency and phase histograms (queue, prefill,
decode, inference) are observed by each request's coroutine as its outputs arrive. Each server has
its own registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class ServerMetrics:
    def __init__(self, model_name: str, prefix: str = "pagedkv") -> None:
        if prefix not in ("pagedkv", "vllm"):
            raise ValueError(f"metrics prefix must be 'pagedkv' or 'vllm', got {prefix!r}")
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.prefix = prefix
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"{prefix}:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(f"{prefix}:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(f"{prefix}:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting for their first step.")
        self.swapped = gauge("num_requests_swapped", "Sequences swapped out to CPU memory.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).")
        self.blocks_used = gauge("kv_cache_blocks_used", "KV cache blocks in use.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Sequences preempted (recompute or swap).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests added (x n samples).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        if prefix == "vllm":  # vLLM's older name of the same gauge, still read by older dashboards
            self.kv_usage_old = gauge("gpu_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).")
        self._success = Counter(
            f"{prefix}:request_success", "Requests finished, by finish reason.", ["model_name", "finished_reason"],
            registry=r,
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between a request's outputs.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to end.", _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token.",
                                      _LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to last token.", _LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "First scheduled to last token.",
                                        _LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens", "Generated tokens per request.",
                                                   _TOKEN_BUCKETS)
        self._seen: dict[str, int] = {}
        self.scheduled_at: dict[str, float] = {}  # engine request id -> when its first step began
        self._last_step_end = time.perf_counter()

    def update_from_engine(self, engine: Any) -> None:
        """Once per step, on the engine thread: queue lengths, pool usage, and counter increments."""
        sched = engine.scheduler
        now = time.perf_counter()
        for seq in sched.running:  # first seen running: its first step began when the previous one ended
            if seq.request_id not in self.scheduled_at:
                self.scheduled_at[seq.request_id] = self._last_step_end
        self._last_step_end = now
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        self.swapped.set(len(sched.swapped))
        used = engine.pool.num_used
        self.blocks_used.set(used)
        self.kv_usage.set(used / engine.num_blocks)
        if self.prefix == "vllm":
            self.kv_usage_old.set(used / engine.num_blocks)
        stats = engine.stats
        current = {
            "preemptions": stats.preemptions,
            "prompt_tokens": stats.prompt_tokens,
            "generation_tokens": stats.generated_tokens,
        }
        if engine.config.enable_prefix_caching:
            plugin = engine.plugin_stats()
            current["prefix_queries"] = plugin.get("prefix_query_tokens", 0)
            current["prefix_hits"] = plugin.get("prefix_hit_tokens", 0)
        for name, value in current.items():
            delta = value - self._seen.get(name, 0)
            if delta > 0:
                getattr(self, name).inc(delta)
            self._seen[name] = value

    def finished(self, reason: str | None) -> None:
        self._success.labels(self.model_name, reason or "unknown").inc()

    def phases(self, request_id: str, arrival: float, first_token: float | None, end: float | None) -> None:
        """Queue / prefill / decode / inference time of one request (``end`` None: only its first token yet)."""
        scheduled = max(self.scheduled_at.get(request_id, arrival), arrival)
        if end is None:
            if first_token is not None:
                self.queue_time.observe(scheduled - arrival)
                self.prefill_time.observe(max(first_token - scheduled, 0.0))
            return
        self.scheduled_at.pop(request_id, None)
        if first_token is not None:
            self.decode_time.observe(max(end - first_token, 0.0))
        self.inference_time.observe(max(end - scheduled, 0.0))

    def forget(self, request_id: str) -> None:
        self.scheduled_at.pop(request_id, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)
