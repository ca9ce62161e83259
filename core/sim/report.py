"""How ``engine simulate`` shows its results: a text table, JSON, and a PNG of blocks in use."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Any

from pagedkv.core.sim.simulate import SWEEP_COLUMNS

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
