"""``engine simulate``: capacity planning with the real pool, allocator, scheduler and plugins.

``Engine(config, simulate=model_config)`` loads no model; its stand-in runner only
counts tokens. This module drives it with a workload: requests are added when the
simulated clock passes their arrival, the clock moves by a step-time model after
each step, and the run's figures (concurrency, KV usage and waste, preemptions,
swap traffic, prefix hits, TTFT and throughput estimates) come back as a dict,
for the paged allocator and the static max-length baseline side by side.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from array import array
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pagedkv.core.errors import ConfigError, PagedKVError
from pagedkv.core.step_time_model import StepTimeModel
from pagedkv.core.workload import Workload, synth_prompt

# SmolLM2-135M's shape: the default when no --model-config is given.
DEFAULT_MODEL = dict(
    model_type="llama", num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    hidden_size=576, intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
)
_GPT2_NAMES = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_embd": "hidden_size",
               "n_positions": "max_position_embeddings", "n_inner": "intermediate_size"}
_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2}


class SimulationError(PagedKVError, ValueError):
    """The simulation cannot run as set up; the message names the setting or request."""


# --- the model's shape and the KV budget -------------------------------------------------------------------------


def load_model_config(path: str | Path | None) -> SimpleNamespace:
    """A model's shape from its HF ``config.json`` (a file or a directory holding one); SmolLM2-135M if None."""
    if path is None:
        return SimpleNamespace(**DEFAULT_MODEL)
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SimulationError(f"--model-config {path}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise SimulationError(f"--model-config {path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise SimulationError(f"--model-config {path}: expected a JSON object")
    raw = dict(raw.get("text_config") or {}, **{k: v for k, v in raw.items() if k != "text_config"})
    for old, new in _GPT2_NAMES.items():
        if old in raw and new not in raw:
            raw[new] = raw[old]
    missing = [k for k in ("num_hidden_layers", "num_attention_heads", "hidden_size") if not raw.get(k)]
    if missing:
        raise SimulationError(f"--model-config {path}: missing {', '.join(missing)}; is it a decoder LM config?")
    raw.setdefault("vocab_size", 32000)
    raw.setdefault("intermediate_size", 4 * raw["hidden_size"])
    raw.setdefault("tie_word_embeddings", False)
    return SimpleNamespace(**raw)


def estimate_params(cfg: Any) -> int:
    """Parameters of a Llama/Qwen/GPT-2-shaped decoder (embeddings, attention, MLP, norms; biases ignored)."""
    h, layers, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or h // heads
    inter = getattr(cfg, "intermediate_size", None) or 4 * h
    gated = getattr(cfg, "model_type", "llama") != "gpt2"
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    mlp = (3 if gated else 2) * h * inter
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or 1
    per_layer = attn + experts * mlp + 2 * h
    embed = vocab * h * (1 if getattr(cfg, "tie_word_embeddings", False) else 2)
    return int(layers * per_layer + embed + h)


def dtype_bytes(dtype: str) -> int:
    try:
        return _DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ConfigError(f"--dtype {dtype!r}: use float32, bfloat16 or float16") from None


def gpu_kv_budget(cfg: Any, gpu_memory: int, utilization: float, dtype: str, num_params: float | None = None) -> dict:
    """KV bytes = gpu_memory * utilization - weights (params * dtype size). Activations are not subtracted."""
    if not 0.0 < utilization <= 1.0:
        raise SimulationError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    params = int(num_params) if num_params else estimate_params(cfg)
    weights = params * dtype_bytes(dtype)
    usable = int(gpu_memory * utilization)
    kv = usable - weights
    if kv <= 0:
        raise SimulationError(
            f"the weights alone (~{params / 1e9:.2f}B params x {dtype_bytes(dtype)} bytes = {_gib(weights)}) do not "
            f"fit in --gpu-memory {_gib(gpu_memory)} x --gpu-memory-utilization {utilization} = {_gib(usable)}; "
            "give more GPU memory, a higher utilization, or a smaller dtype"
        )
    return {"gpu_memory": gpu_memory, "utilization": utilization, "params": params, "weight_bytes": weights,
            "kv_bytes": kv, "note": "KV = gpu_memory x utilization - params x dtype size; activations not subtracted"}


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


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
    enable_prefix_caching: bool = False
    swap_space: int | str | None = None
    allocator: str = "paged"
    trace: str | None = None

    def engine_config(self) -> Any:
        from pagedkv.core.config import EngineConfig

        dtype = "bfloat16" if self.dtype.lower() in ("float16", "fp16", "half") else self.dtype  # same size, CPU-legal
        return EngineConfig(
            allocator=self.allocator, block_size=self.block_size, num_blocks=self.num_blocks,
            kv_cache_memory=self.kv_cache_memory, max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, dtype=dtype, device="cpu",
            enable_prefix_caching=self.enable_prefix_caching, swap_space=self.swap_space, trace=self.trace,
        )


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    s = sorted(values)

    def q(p: float) -> float:
        return s[min(len(s) - 1, max(0, math.ceil(p * len(s)) - 1))]

    return {"mean": sum(s) / len(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


def _recording_runner(engine: Any) -> Any:
    """The engine's stand-in runner, also keeping the last step's scheduler output (for the clock)."""
    from pagedkv.core.simulated_runner import SimulatedRunner

    class _Runner(SimulatedRunner):
        last: Any = None

        def execute(self, out: Any) -> Any:
            self.last = out
            return super().execute(out)

    runner = _Runner()
    runner.cpu_kv_caches = engine.runner.cpu_kv_caches
    return runner


def run_once(
    workload: Workload,
    setup: SimSetup,
    step_time: StepTimeModel | None = None,
    *,
    plugins: tuple[Any, ...] = (),
    series: bool = True,
) -> dict:
    """Run the workload once through ``Engine(simulate=...)``; returns the run's figures."""
    import time

    from pagedkv.core.engine import Engine
    from pagedkv.core.errors import RequestRejected
    from pagedkv.core.sampling_params import SamplingParams

    try:
        engine = Engine(setup.engine_config(), plugins=plugins, simulate=setup.model_config)
    except ConfigError as exc:
        raise SimulationError(f"{exc} (setting: {_budget_text(setup)})") from None
    engine.runner = runner = _recording_runner(engine)
    _check_fits(workload, engine, setup)
    if step_time is None:
        step_time = default_step_time(setup, engine)
    bs = setup.block_size
    reqs = sorted(
        enumerate(workload.requests),
        key=lambda p: (p[1].arrival_step or 0) if workload.clock == "step" else p[1].arrival,
    )
    by_step = workload.clock == "step"
    vocab = engine.vocab_size
    arrival: dict[str, float] = {}
    prompt_len: dict[str, int] = {}
    first_token: dict[str, float] = {}
    finished: dict[str, float] = {}
    t_used = array("d")
    used_series = array("i")
    running_sum = running_time = usage_sum = waste_sum = 0.0
    waste_steps = 0
    peak_running = 0
    now = 0.0
    step = 0
    i, n = 0, len(reqs)
    started = time.perf_counter()
    num_blocks = engine.num_blocks
    sched = engine.scheduler
    pool = engine.pool
    while i < n or engine.has_unfinished():
        if not engine.has_unfinished():  # idle: jump to the next arrival
            if by_step:
                step = max(step, reqs[i][1].arrival_step or 0)
            else:
                now = max(now, reqs[i][1].arrival)
        while i < n and (
            (reqs[i][1].arrival_step or 0) <= step if by_step else reqs[i][1].arrival <= now
        ):
            index, req = reqs[i]
            rid = req.request_id if req.request_id is not None else str(index)
            params = SamplingParams(max_tokens=req.output_len, ignore_eos=True, n=req.n)
            try:
                engine.add_request(synth_prompt(req, index, vocab), params, request_id=rid)
            except RequestRejected as exc:
                raise SimulationError(f"{req.source}: {exc}") from None
            arrival[rid] = now
            prompt_len[rid] = req.prompt_len
            i += 1
        outs = engine.step(stream=False)
        out = runner.last
        step += 1
        prefill = decodes = context = 0
        for item in out.scheduled:
            seq = item.seq
            ctx = item.context_len
            if item.num_new_tokens == 1 and ctx >= prompt_len[seq.request_id]:
                decodes += 1
                context += ctx
            else:
                prefill += item.num_new_tokens
        dt = step_time.step_seconds(prefill, decodes, context)
        now += dt
        for item in out.scheduled:  # (after the step, so ``item.samples`` no longer holds)
            rid = item.seq.request_id
            if rid not in first_token and item.context_len + item.num_new_tokens >= prompt_len[rid]:
                first_token[rid] = now
        for o in outs:
            finished[o.request_id] = now
        running = len(sched.running)
        peak_running = max(peak_running, running)
        running_sum += running
        running_time += running * dt
        used = pool.num_used
        usage_sum += used
        if used:
            waste_sum += 1.0 - engine._tokens_held() / (used * bs)
            waste_steps += 1
        if series:
            t_used.append(now)
            used_series.append(used)
    wall = time.perf_counter() - started
    if setup.trace:
        from pagedkv.plugins.telemetry import close as close_telemetry

        close_telemetry(engine)
    from pagedkv.core.cli import summarize

    stats = engine.stats
    summary = summarize(engine)
    steps = max(1, stats.steps)
    first_arrival = min(arrival.values()) if arrival else 0.0
    makespan = max(now - first_arrival, 1e-12)
    ttft = [first_token[r] - arrival[r] for r in first_token]
    e2e = [finished[r] - arrival[r] for r in finished]
    result = {
        "allocator": setup.allocator,
        "block_size": bs,
        "num_blocks": num_blocks,
        "kv_bytes": num_blocks * engine.spec.bytes_per_block,
        "bytes_per_block": engine.spec.bytes_per_block,
        "max_model_len": engine.max_model_len,
        "requests": stats.requests,
        "finished": len(finished),
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": stats.generated_tokens,
        "steps": stats.steps,
        "peak_running": peak_running,
        "mean_running": running_sum / steps,
        "mean_running_time_weighted": running_time / makespan,
        "peak_kv_blocks_used": stats.peak_blocks_used,
        "peak_kv_usage_pct": 100.0 * stats.peak_blocks_used / num_blocks,
        "mean_kv_usage_pct": 100.0 * usage_sum / steps / num_blocks,
        "kv_waste_pct_at_peak": 100.0 * stats.waste_at_peak,
        "mean_kv_waste_pct": 100.0 * waste_sum / waste_steps if waste_steps else 0.0,
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
        result["series"] = {"t": t_used, "blocks_used": used_series}
    return result


def default_step_time(setup: SimSetup, engine: Any = None) -> StepTimeModel:
    cfg = setup.model_config
    params = getattr(cfg, "_sim_num_params", None) or estimate_params(cfg)
    size = dtype_bytes(setup.dtype)
    return StepTimeModel.roofline(params, params * size, bytes_per_block(setup) / setup.block_size)


def bytes_per_block(setup: SimSetup) -> int:
    """The engine's own sizing (``KVCacheSpec``) for this setup's model, block size and dtype."""
    from pagedkv.core.config import parse_dtype
    from pagedkv.core.kv_cache import KVCacheSpec

    dtype = parse_dtype("bfloat16" if dtype_bytes(setup.dtype) == 2 else "float32")
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
    workload: Workload, setup: SimSetup, step_time: StepTimeModel | None, key: str, values: list[int]
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
        rows.append({key: value, **_row(run_once(workload, s, step_time, series=False))})
    return {"key": key, "rows": rows}


def simulate(
    workload: Workload,
    setup: SimSetup,
    step_time: StepTimeModel | None = None,
    *,
    compare_static: bool = True,
    sweeps: list[tuple[str, list[int]]] = (),
) -> dict:
    """Paged run (with ``setup.trace``), the static baseline, and any sweeps, as one dict."""
    from pagedkv.core.workload import describe

    paged = run_once(workload, replace(setup, allocator="paged"), step_time)
    report: dict[str, Any] = {"workload": describe(workload), "paged": paged}
    if compare_static:
        report["static"] = run_once(workload, replace(setup, allocator="static", trace=None), step_time)
    report["sweeps"] = [run_sweep(workload, setup, step_time, key, values) for key, values in sweeps]
    return report


# --- output ----------------------------------------------------------------------------------------------------------

REPORT_ROWS = (
    ("num_blocks", "KV blocks", "{:d}"),
    ("kv_bytes", "KV bytes", "{}"),
    ("max_model_len", "max model len", "{:d}"),
    ("peak_running", "peak concurrency", "{:d}"),
    ("mean_running", "mean concurrency (per step)", "{:.1f}"),
    ("mean_running_time_weighted", "mean concurrency (over time)", "{:.1f}"),
    ("peak_kv_usage_pct", "peak KV usage %", "{:.1f}"),
    ("mean_kv_usage_pct", "mean KV usage %", "{:.1f}"),
    ("kv_waste_pct_at_peak", "KV waste % at peak", "{:.1f}"),
    ("mean_kv_waste_pct", "mean KV waste %", "{:.1f}"),
    ("preemptions", "preemptions", "{:d}"),
    ("tokens_recomputed", "tokens recomputed", "{:d}"),
    ("swap_outs", "swap-outs", "{:d}"),
    ("swap_ins", "swap-ins", "{:d}"),
    ("swap_bytes_moved", "swap bytes moved", "{}"),
    ("prefix_hit_rate", "prefix hit rate", "{}"),
    ("steps", "engine steps", "{:d}"),
    ("sim_time_s", "simulated time s", "{:.2f}"),
    ("throughput_tokens_per_s", "est. output tokens/s", "{:.0f}"),
    ("throughput_requests_per_s", "est. requests/s", "{:.2f}"),
    ("ttft_p50", "est. TTFT p50 s", "{:.3f}"),
    ("ttft_p99", "est. TTFT p99 s", "{:.3f}"),
    ("latency_p50", "est. latency p50 s", "{:.3f}"),
    ("wall_s", "simulator wall s", "{:.2f}"),
)


def _cell(result: dict | None, key: str, fmt: str) -> str:
    if result is None:
        return "-"
    if key.startswith(("ttft_", "latency_")):
        name, _, q = key.rpartition("_")
        value = result[f"{name}_s"][q]
    else:
        value = result.get(key)
    if value is None:
        return "-"
    if key in ("kv_bytes", "swap_bytes_moved"):
        return _human_bytes(value)
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def _human_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def format_report(report: dict) -> str:
    """Plain text: the workload, paged vs static, the sweep tables."""
    wl = report["workload"]
    paged, static = report["paged"], report.get("static")
    lines = [
        f"workload: {wl['name']}, {wl['requests']} requests, mean prompt {wl['mean_prompt_len']}, "
        f"mean output {wl['mean_output_len']} tokens",
        *[f"  {note}" for note in wl["notes"]],
    ]
    if "budget" in report:
        b = report["budget"]
        lines.append(f"KV budget: {b['text']}")
    st = paged["step_time_model"]
    lines.append(
        f"step time: {st['fixed_ms']} ms + {st['prefill_us_per_token']} us/prefill token + "
        f"{st['decode_us_per_seq']} us/decode seq + {st['context_ns_per_token']} ns/context token ({st['source']})"
    )
    lines.append("")
    width = max(len(label) for _, label, _ in REPORT_ROWS)
    lines.append(f"{'':{width}}  {'paged':>14}  {'static':>14}")
    for key, label, fmt in REPORT_ROWS:
        lines.append(f"{label:{width}}  {_cell(paged, key, fmt):>14}  {_cell(static, key, fmt):>14}")
    for sweep in report.get("sweeps", []):
        lines.append("")
        lines.append(f"sweep {sweep['key']} (paged):")
        cols = [sweep["key"], *SWEEP_COLUMNS]
        lines.append("  ".join(f"{c:>12}" for c in cols))
        for row in sweep["rows"]:
            cells = []
            for c in cols:
                v = row.get(c)
                cells.append(f"{'-' if v is None else (f'{v:.3g}' if isinstance(v, float) else v):>12}")
            lines.append("  ".join(cells))
    if "plot" in report:
        lines.append("")
        lines.append(report["plot"])
    return "\n".join(lines)


def jsonable(report: dict) -> dict:
    """The report without its per-step series (those go to the plot)."""

    def clean(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: clean(v) for k, v in obj.items() if k != "series"}
        if isinstance(obj, list):
            return [clean(v) for v in obj]
        if isinstance(obj, float):
            return round(obj, 6)
        return obj

    return clean(report)


# --- the plot: a PNG written by hand (no matplotlib needed) ---------------------------------------------------------


def write_png(path: str | Path, pixels: list[bytearray], width: int, height: int) -> None:
    """RGB rows -> a PNG file (zlib, one filter byte per row)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + bytes(row) for row in pixels)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")
    Path(path).write_bytes(png)


def plot_blocks(path: str | Path, report: dict, width: int = 900, height: int = 320) -> str:
    """Blocks in use over simulated time: paged (blue, filled), static (orange line), capacity (grey).

    Returns a caption with the axes' ranges (the PNG has no text).
    """
    runs = [(report["paged"], (66, 114, 196), True)]
    if report.get("static"):
        runs.append((report["static"], (230, 126, 34), False))
    t_max = max((r["series"]["t"][-1] for r, _, _ in runs if len(r["series"]["t"])), default=1.0) or 1.0
    y_max = max(r["num_blocks"] for r, _, _ in runs)
    pad = 10
    w, h = width - 2 * pad, height - 2 * pad
    pixels = [bytearray(b"\xff" * (3 * width)) for _ in range(height)]

    def put(x: int, y: int, rgb: tuple[int, int, int]) -> None:
        if 0 <= x < width and 0 <= y < height:
            pixels[y][3 * x : 3 * x + 3] = bytes(rgb)

    for x in range(pad, pad + w):  # axes and the capacity line
        put(x, pad + h, (0, 0, 0))
        put(x, pad, (150, 150, 150))
    for y in range(pad, pad + h + 1):
        put(pad, y, (0, 0, 0))
    for result, rgb, fill in runs:
        t, used = result["series"]["t"], result["series"]["blocks_used"]
        column: list[int] = [-1] * w  # the max blocks used in each pixel column
        for ti, ui in zip(t, used):
            x = min(w - 1, int(ti / t_max * (w - 1)))
            if ui > column[x]:
                column[x] = ui
        last = 0
        for x in range(min(w, int(t[-1] / t_max * (w - 1)) + 1) if len(t) else 0):
            value = column[x] if column[x] >= 0 else last
            last = value
            top = pad + h - int(value / y_max * h)
            if fill:
                light = tuple(min(255, c + (255 - c) * 2 // 3) for c in rgb)
                for y in range(top, pad + h):
                    put(pad + x, y, light)
            put(pad + x, top, rgb)
            put(pad + x, top + 1, rgb)
    write_png(path, pixels, width, height)
    return (
        f"plot: {path} (x: simulated time 0..{t_max:.1f} s; y: KV blocks in use 0..{y_max}, grey line = capacity; "
        "blue filled = paged" + (", orange = static" if report.get("static") else "") + ")"
    )


# --- the command line (``engine simulate``; core/cli.py adds the subparser and dispatches here) -------------------


def add_arguments(p: Any) -> None:
    p.add_argument("--workload", default="sharegpt",
                   help="sharegpt, alpaca, shared-prefix, a requests .jsonl, or a trace from `engine run --trace`")
    p.add_argument("--num-requests", type=int, default=1000, help="for a built-in workload (default 1000)")
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second (default: all at 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-config", default=None, help="HF config.json (or its dir) for the KV shape; "
                   "default: SmolLM2-135M's shape")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--kv-cache-memory", default=None, help="KV budget in bytes (e.g. 40GiB)")
    budget.add_argument("--num-blocks", type=int, default=None, help="KV budget in blocks")
    budget.add_argument("--gpu-memory", default=None,
                        help="plan for a GPU of this size (e.g. 80GiB): KV = size x utilization - weights")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="with --gpu-memory (default 0.9)")
    p.add_argument("--num-params", type=float, default=None, help="with --gpu-memory: override the params estimate")
    p.add_argument("--dtype", default="bfloat16", help="KV and weight dtype size: bfloat16/float16 (2), float32 (4)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--swap-space", default=None, help="CPU swap space, e.g. 4GiB (its pool is allocated on CPU)")
    p.add_argument("--step-time", default=None, metavar="K=V,...",
                   help="fixed_ms, prefill_us_per_token, decode_us_per_seq, context_ns_per_token")
    p.add_argument("--calibrate", default=None, metavar="TRACE", help="fit the step-time model to a recorded trace")
    p.add_argument("--no-static", action="store_true", help="skip the static max-length allocator's run")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                   help=f"a table over one setting ({', '.join(SWEEP_KEYS)}); repeatable")
    p.add_argument("--plot", default=None, metavar="PNG", help="blocks in use over time, paged vs static")
    p.add_argument("--trace", default=None, metavar="FILE", help="record the paged run for `engine monitor --replay`")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")


def setup_from_args(args: Any) -> tuple[SimSetup, dict]:
    from pagedkv.core.config import parse_bytes

    cfg = load_model_config(args.model_config)
    if args.num_params:
        cfg._sim_num_params = int(args.num_params)
    setup = SimSetup(
        model_config=cfg, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len, dtype=args.dtype,
        enable_prefix_caching=args.enable_prefix_caching, swap_space=args.swap_space, trace=args.trace,
    )
    dtype_bytes(args.dtype)
    if args.gpu_memory is not None:
        b = gpu_kv_budget(cfg, parse_bytes(args.gpu_memory), args.gpu_memory_utilization, args.dtype, args.num_params)
        setup.kv_cache_memory = b["kv_bytes"]
        text = (f"{_gib(b['kv_bytes'])} = {_gib(b['gpu_memory'])} x {b['utilization']} - weights "
                f"{_gib(b['weight_bytes'])} (~{b['params'] / 1e6:.0f}M params x {dtype_bytes(args.dtype)} B); "
                "activations not subtracted")
        budget = {**b, "text": text}
    elif args.num_blocks is not None:
        setup.num_blocks = args.num_blocks
        budget = {"num_blocks": args.num_blocks, "text": f"{args.num_blocks} blocks (--num-blocks)"}
    else:
        memory = args.kv_cache_memory or "1GiB"
        setup.kv_cache_memory = parse_bytes(memory)
        budget = {"kv_bytes": setup.kv_cache_memory,
                  "text": f"{memory} (--kv-cache-memory" + ("" if args.kv_cache_memory else ", the default") + ")"}
    return setup, budget


def run_cli(args: Any) -> int:
    from pagedkv.core.step_time_model import calibrate_from_trace
    from pagedkv.core.workload import load_workload

    setup, budget = setup_from_args(args)
    sweeps = [parse_sweep(s) for s in args.sweep]
    step_time = calibrate_from_trace(args.calibrate) if args.calibrate else default_step_time(setup)
    if args.step_time:
        step_time = step_time.with_overrides(args.step_time)
    workload = load_workload(
        args.workload, num_requests=args.num_requests, seed=args.seed, request_rate=args.request_rate
    )
    report = simulate(workload, setup, step_time, compare_static=not args.no_static, sweeps=sweeps)
    report["budget"] = budget
    if args.plot:
        report["plot"] = plot_blocks(args.plot, report)
    if args.trace:
        report["trace"] = args.trace
    if args.json:
        print(json.dumps(jsonable(report), indent=2))
    else:
        print(format_report(report))
        if args.trace:
            print(f"trace: {args.trace} (engine monitor --replay {args.trace})")
    return 0
