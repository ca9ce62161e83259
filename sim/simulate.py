"""``engine simulate``: capacity planning with the real pool, allocator, scheduler and plugins.

``SimEngine(config, runner=SimulatedRunner(model_config))`` loads no model; its
stand-in runner only counts tokens. This module drives it with a workload: requests
are added when the simulated clock passes their arrival, the clock moves by a
step-time model after each step (the steps that only move the decode lane are taken
past the engine's step, see :mod:`~pagedkv.sim.lane_run`; the figures add up in a
:class:`~pagedkv.sim.tally.RunTally`), and the run's figures (concurrency, KV usage and waste, preemptions,
swap traffic, prefix hits, TTFT and throughput estimates) come back as a dict,
for the paged allocator and the static max-length baseline side by side.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from pagedkv.core.errors import ConfigError
from pagedkv.core.stats import summarize
from pagedkv.sim import lane_run
from pagedkv.sim.model_budget import (
    SimulationError,
    dtype_bytes,
    estimate_params,
    load_model_config,
    weight_bytes_per_param,
)
from pagedkv.sim.step_time_model import StepTimeModel
from pagedkv.sim.tally import RunTally
from pagedkv.sim.workload import Workload, synth_prompt

# --- one simulated run -------------------------------------------------------------------------------------------

@dataclass
class SimSetup:
    """What ``engine simulate`` varies: an :class:`EngineConfig` on CPU plus the model's shape."""

    model_config: Any = field(default_factory=lambda: load_model_config(None))
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | str | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"  # as engine run's --kv-cache-dtype; auto: the dtype above
    quantization: str | None = None  # the weights' (model_budget.QUANT_BYTES): the bytes a decode step reads
    enable_prefix_caching: bool = False
    swap_space: int | str | None = None
    allocator: str = "paged"
    trace: str | None = None
    decode_lane: bool = True  # False: step every sequence one by one (same results, slower; for checking)
    jump: bool = True  # jump over quiet steps in one move (same results; False takes them one by one)

    def engine_config(self) -> Any:
        from pagedkv.core.config import EngineConfig

        dtype = "bfloat16" if self.dtype.lower() in ("float16", "fp16", "half") else self.dtype  # same size, CPU-legal
        return EngineConfig(
            allocator=self.allocator, block_size=self.block_size, num_blocks=self.num_blocks,
            kv_cache_memory=self.kv_cache_memory, max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, dtype=dtype, device="cpu",
            kv_cache_dtype=self.kv_cache_dtype,
            enable_prefix_caching=self.enable_prefix_caching, swap_space=self.swap_space, trace=self.trace,
            # a simulated trace is read back whole: a keyframe (every live request) every 1000 steps is plenty
            plugin_options={"telemetry": {"keyframe_steps": 1000, "keyframe_s": 60.0}} if self.trace else {},
        )


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    s = sorted(values)

    def q(p: float) -> float:
        return s[min(len(s) - 1, max(0, math.ceil(p * len(s)) - 1))]

    return {"mean": sum(s) / len(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


@contextmanager
def _cyclic_gc_off() -> Iterator[None]:
    """A run keeps ~10 objects per request alive and makes almost no reference cycles: the cyclic
    collector's passes over the live ones are pure cost, growing with the run (15% of a 20k-request run)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


@_cyclic_gc_off()
def run_once(
    workload: Workload,
    setup: SimSetup,
    step_time: StepTimeModel | None = None,
    *,
    plugins: tuple[Any, ...] = (),
    series: bool = True,
    progress: Callable[[int, int], None] | None = None,
    after_run: Callable[[Any], None] | None = None,
) -> dict:
    """Run the workload once through a :class:`SimEngine`; returns the run's figures.

    ``progress(finished, total)`` is called every few hundred steps and once at the end;
    ``after_run(engine)`` when the last request finished, before the figures are read
    (the command line closes a trace with it).
    """
    import time

    from pagedkv.sim.sim_engine import SimEngine
    from pagedkv.sim.simulated_runner import SimulatedRunner

    runner = SimulatedRunner(setup.model_config, logits=False)  # (SimEngine samples without them)
    prompt_len: dict[str, int] = {}
    tally = RunTally(step_time, setup.block_size, prompt_len, series, progress, len(workload.requests))
    try:  # telemetry stamps the simulated clock, so a replay's --speed is relative to the simulated run
        engine = SimEngine(setup.engine_config(), runner=runner, plugins=plugins, decode_lane=setup.decode_lane,
                           clock=lambda: tally.now)
    except ConfigError as exc:
        raise SimulationError(f"{exc} (setting: {_budget_text(setup)})") from None
    _check_fits(workload, engine, setup)
    if step_time is None:
        tally.step_time = step_time = default_step_time(setup, engine)
    started = time.perf_counter()
    arrival = _drive(workload, setup, engine, runner, tally, prompt_len)
    if progress is not None:
        progress(len(tally.finished), len(workload.requests))
    wall = time.perf_counter() - started
    if after_run is not None:
        after_run(engine)
    return _figures(setup, engine, tally, arrival, wall, step_time, series)


def _drive(workload: Workload, setup: SimSetup, engine: Any, runner: Any, tally: RunTally,
           prompt_len: dict[str, int]) -> dict[str, float]:
    """Step the engine until every request has arrived and finished, adding each when the clock passes its
    arrival (idle spells jumped over); returns each request's arrival time."""
    from pagedkv.core.errors import RequestRejected
    from pagedkv.core.sample.sampling_params import SamplingParams

    by_step = workload.clock == "step"
    reqs = sorted(enumerate(workload.requests),
                  key=lambda p: (p[1].arrival_step or 0) if by_step else p[1].arrival)
    vocab = engine.vocab_size
    arrival: dict[str, float] = {}
    shared_params: dict[tuple[int, int], SamplingParams] = {}
    i, n = 0, len(reqs)
    while i < n or engine.has_unfinished():
        if not engine.has_unfinished():  # idle: jump to the next arrival
            if by_step:
                tally.step = max(tally.step, reqs[i][1].arrival_step or 0)
            else:
                tally.now = max(tally.now, reqs[i][1].arrival)
        while i < n and (
            (reqs[i][1].arrival_step or 0) <= tally.step if by_step else reqs[i][1].arrival <= tally.now
        ):
            index, req = reqs[i]
            rid = req.request_id if req.request_id is not None else str(index)
            params = shared_params.get((req.output_len, req.n))  # (add_request takes its own checked copy)
            if params is None:
                params = shared_params[req.output_len, req.n] = SamplingParams(
                    max_tokens=req.output_len, ignore_eos=True, n=req.n)
            try:
                engine.add_request(synth_prompt(req, index, vocab), params, request_id=rid)
            except RequestRejected as exc:
                raise SimulationError(f"{req.source}: {exc}") from None
            arrival[rid] = tally.now
            prompt_len[rid] = req.prompt_len
            i += 1
        outs = engine.step(stream=False)
        tally.real_step(engine, runner.last, outs)
        if setup.jump:  # the steps ahead that only move the decode lane, up to the next arrival
            if i >= n:
                lane_run.run_lane(engine, tally, None, None)
            elif by_step:
                lane_run.run_lane(engine, tally, None, reqs[i][1].arrival_step or 0)
            else:
                lane_run.run_lane(engine, tally, reqs[i][1].arrival, None)
    return arrival


def _figures(setup: SimSetup, engine: Any, tally: RunTally, arrival: dict[str, float], wall: float,
             step_time: StepTimeModel, series: bool) -> dict:
    """The run's figures, from the engine's stats and the tally."""
    finished, first_token, now = tally.finished, tally.first_token, tally.now
    num_blocks = engine.num_blocks
    stats = engine.stats
    summary = summarize(engine)
    steps = max(1, stats.steps)
    first_arrival = min(arrival.values()) if arrival else 0.0
    makespan = max(now - first_arrival, 1e-12)
    ttft = [first_token[r] - arrival[r] for r in first_token]
    e2e = [finished[r] - arrival[r] for r in finished]
    result = {
        "allocator": setup.allocator,
        "block_size": setup.block_size,
        "num_blocks": num_blocks,
        "kv_bytes": num_blocks * engine.spec.bytes_per_block,
        "bytes_per_block": engine.spec.bytes_per_block,
        "max_model_len": engine.max_model_len,
        "requests": stats.requests,
        "finished": len(finished),
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": stats.generated_tokens,
        "steps": stats.steps,
        "peak_running": tally.peak_running,
        "mean_running": tally.running_sum / steps,
        "mean_running_time_weighted": tally.running_time / makespan,
        "peak_kv_blocks_used": stats.peak_blocks_used,
        "peak_kv_usage_pct": 100.0 * stats.peak_blocks_used / num_blocks,
        "mean_kv_usage_pct": 100.0 * tally.usage_sum / steps / num_blocks,
        "kv_waste_pct_at_peak": 100.0 * stats.waste_at_peak,
        "mean_kv_waste_pct": 100.0 * tally.waste_sum / tally.waste_steps if tally.waste_steps else 0.0,
        "preemptions": stats.preemptions,
        "tokens_recomputed": stats.tokens_recomputed,
        "prefill_tokens_computed": stats.prefill_tokens_computed,
        "swap_outs": summary.get("swap_outs", 0),
        "swap_ins": summary.get("swap_ins", 0),
        "swap_bytes_moved": summary.get("swap_bytes_moved", 0),
        "prefix_hit_rate": summary.get("prefix_hit_rate"),
        "prefix_hit_tokens": summary.get("prefix_hit_tokens"),
        "sim_time_s": makespan,
        "throughput_tokens_per_s": stats.generated_tokens / makespan,
        "throughput_requests_per_s": len(finished) / makespan,
        "ttft_s": _percentiles(ttft),
        "latency_s": _percentiles(e2e),
        "wall_s": wall,
        "step_time_model": step_time.describe(),
    }
    if series:
        result["series"] = {"t": tally.t_used, "blocks_used": tally.used_series}
    return result


def _labelled(progress: Callable[[str, int, int], None] | None, label: str) -> Callable[[int, int], None] | None:
    return None if progress is None else (lambda done, total: progress(label, done, total))


def default_step_time(setup: SimSetup, engine: Any = None) -> StepTimeModel:
    cfg = setup.model_config
    params = getattr(cfg, "_sim_num_params", None) or estimate_params(cfg)
    size = weight_bytes_per_param(setup.dtype, setup.quantization)
    return StepTimeModel.roofline(params, params * size, bytes_per_block(setup) / setup.block_size)


def bytes_per_block(setup: SimSetup) -> int:
    """The engine's own sizing (``KVCacheSpec``) for this setup's model, block size and KV dtype."""
    from pagedkv.core.config import parse_dtype, parse_kv_cache_dtype
    from pagedkv.core.kv.kv_cache import KVCacheSpec

    dtype = parse_dtype("bfloat16" if dtype_bytes(setup.dtype) == 2 else "float32")
    dtype = parse_kv_cache_dtype(setup.kv_cache_dtype, dtype)
    return KVCacheSpec.from_model_config(setup.model_config, setup.block_size, dtype).bytes_per_block


def _budget_text(setup: SimSetup) -> str:
    if setup.num_blocks is not None:
        return f"--num-blocks {setup.num_blocks} at --block-size {setup.block_size}"
    if setup.kv_cache_memory is not None:
        return f"KV budget {setup.kv_cache_memory} bytes at --block-size {setup.block_size}"
    return f"the default KV budget at --block-size {setup.block_size}"


def _check_fits(workload: Workload, engine: Any, setup: SimSetup) -> None:
    """Refuse, naming the request and the setting, a workload with a prompt that can never be served."""
    limit = engine.max_model_len
    for req in workload.requests:
        if req.prompt_len > limit:
            why = (
                f"the KV cache holds only {engine.capacity_tokens} tokens ({_budget_text(setup)})"
                if limit == engine.capacity_tokens
                else f"max_model_len is {limit}"
            )
            raise SimulationError(
                f"{req.source}: a {req.prompt_len}-token prompt can never run: {why}; "
                "give a larger KV budget (--num-blocks / --kv-cache-memory / --gpu-memory) or a shorter prompt"
            )


# --- the whole report ----------------------------------------------------------------------------------------------

SWEEP_KEYS = ("block_size", "kv_blocks", "max_num_seqs", "max_num_batched_tokens")


def parse_sweep(text: str) -> tuple[str, list[int]]:
    key, sep, values = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or key not in SWEEP_KEYS:
        raise ConfigError(f"--sweep {text!r}: use KEY=V1,V2,... with KEY one of {', '.join(SWEEP_KEYS)}")
    try:
        parsed = [int(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--sweep {text!r}: the values must be integers") from None
    if not parsed or any(v < 1 for v in parsed):
        raise ConfigError(f"--sweep {text!r}: give one or more positive integers")
    return key, parsed


SWEEP_COLUMNS = (
    "num_blocks", "peak_running", "mean_running", "peak_kv_usage_pct", "mean_kv_waste_pct", "preemptions",
    "tokens_recomputed", "throughput_tokens_per_s", "ttft_p50_s", "ttft_p99_s",
)


def _row(result: dict) -> dict:
    row = {k: result[k] for k in SWEEP_COLUMNS if k in result}
    row["ttft_p50_s"] = result["ttft_s"]["p50"]
    row["ttft_p99_s"] = result["ttft_s"]["p99"]
    return row


def run_sweep(
    workload: Workload,
    setup: SimSetup,
    step_time: StepTimeModel | None,
    key: str,
    values: list[int],
    progress: Callable[[str, int, int], None] | None = None,
) -> dict:
    """The paged allocator at each value; a block-size sweep keeps the KV bytes fixed."""
    base_bytes = setup.num_blocks * bytes_per_block(setup) if setup.num_blocks is not None else None
    rows = []
    for value in values:
        if key == "block_size":
            s = replace(setup, block_size=value, trace=None, allocator="paged")
            if base_bytes is not None:
                s = replace(s, num_blocks=None, kv_cache_memory=base_bytes)
        elif key == "kv_blocks":
            s = replace(setup, num_blocks=value, kv_cache_memory=None, trace=None, allocator="paged")
        else:
            s = replace(setup, **{key: value}, trace=None, allocator="paged")
        report = _labelled(progress, f"{key}={value}")
        rows.append({key: value, **_row(run_once(workload, s, step_time, series=False, progress=report))})
    return {"key": key, "rows": rows}


def simulate(
    workload: Workload,
    setup: SimSetup,
    step_time: StepTimeModel | None = None,
    *,
    compare_static: bool = True,
    sweeps: list[tuple[str, list[int]]] = (),
    progress: Callable[[str, int, int], None] | None = None,
    after_run: Callable[[Any], None] | None = None,
    parallel: bool = True,
) -> dict:
    """Paged run (with ``setup.trace``; ``after_run`` is called on its engine), the static baseline,
    and any sweeps, as one dict. With ``parallel`` (and two cores), the static run goes in a forked
    child beside the paged one (:mod:`pagedkv.sim.side_run`); the figures are the same."""
    from pagedkv.sim.side_run import SideRun, can_fork
    from pagedkv.sim.workload import describe

    static_setup = replace(setup, allocator="static", trace=None)
    side = None
    if compare_static and parallel and can_fork():
        side = SideRun(lambda report: run_once(workload, static_setup, step_time, progress=report),
                       report_progress=progress is not None)
    paged_progress = _labelled(progress, "paged")
    if side is not None and paged_progress is not None:
        static_progress, own = _labelled(progress, "static"), paged_progress

        def paged_progress(done: int, total: int) -> None:
            own(done, total)
            side.poll(static_progress)

    paged = run_once(workload, replace(setup, allocator="paged"), step_time, progress=paged_progress,
                     after_run=after_run)
    report: dict[str, Any] = {"workload": describe(workload), "paged": paged}
    if side is not None:
        report["static"] = side.result(_labelled(progress, "static"))
    elif compare_static:
        report["static"] = run_once(workload, static_setup, step_time, progress=_labelled(progress, "static"))
    report["sweeps"] = [run_sweep(workload, setup, step_time, key, values, progress) for key, values in sweeps]
    return report
