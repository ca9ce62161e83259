"""How ``engine simulate`` shows its results: a text table and JSON (the plot is in plot.py)."""

from __future__ import annotations

from typing import Any

from pagedkv.sim.simulate import SWEEP_COLUMNS

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
