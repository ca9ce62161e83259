"""The report: rows of every worker combined into tables, written to ``$OUT`` after every phase."""

from __future__ import annotations

import math
from typing import Any

GOAL_PCT, GOAL_RATIO, GOAL_SPEEDUP = 80.0, 1.10, 2.0


BASELINES = ("sdpa", "sdpa_flash")  # contiguous K/V: the default SDPA dispatch, and FlashAttention only


def combine(rows: list[dict[str, Any]]) -> tuple[dict[str, Any], float | None, list[dict[str, Any]]]:
    """Kernel points with bandwidth, share of copy bandwidth, and time over the faster contiguous baseline."""
    env = next((r for r in rows if r.get("kind") == "env"), {})
    copy_row = next((r for r in rows if r.get("kind") == "copy"), None)
    copy_gbps = copy_row["gbps"] if copy_row else None
    points = [r for r in rows if r.get("kind") == "point"]

    def key(r: dict[str, Any]) -> tuple:
        return (r["shape"], r["dtype"], r["batch"], r["context"])

    base: dict[tuple, float] = {}
    for r in points:
        if r["backend"] in BASELINES and "median_us" in r and r.get("ok", True):
            base[key(r)] = min(base.get(key(r), math.inf), r["median_us"])
    for r in points:
        if "median_us" not in r:
            continue
        r["gbps"] = r["bytes"] / r["median_us"] / 1e3
        r["pct_copy"] = 100 * r["gbps"] / copy_gbps if copy_gbps else None
        r["x_contig"] = r["median_us"] / base[key(r)] if key(r) in base else None
        if r["main"] and r["backend"] not in BASELINES:
            r["goal"] = bool(r["pct_copy"] is not None and r["x_contig"] is not None and r["pct_copy"] >= GOAL_PCT
                             and r["x_contig"] <= GOAL_RATIO and r.get("ok"))
    order = {b: i for i, b in enumerate((*BASELINES, "torch", "triton", "cupy"))}
    points.sort(key=lambda r: (not r["main"], r["shape"], r["dtype"], r["batch"], r["context"],
                               order.get(r["backend"], 9)))
    return env, copy_gbps, points


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def bench_table(points: list[dict[str, Any]]) -> list[list[str]]:
    head = ["backend", "shape", "dtype", "batch", "ctx", "time us", "GB/s", "% copy", "x contig", "max err",
            "goal/note"]
    lines = [head]
    for r in points:
        if "median_us" in r:
            note = "" if r.get("ok", True) else "WRONG RESULT"
            if "goal" in r:
                note = ("goal met" if r["goal"] else "goal missed") + (f"; {note}" if note else "")
            cells = [_fmt(r["median_us"], ".1f"), _fmt(r.get("gbps"), ".0f"), _fmt(r.get("pct_copy"), ".1f"),
                     _fmt(r.get("x_contig"), ".2f"), _fmt(r.get("max_err"), ".1e"), note]
        else:
            cells = ["-", "-", "-", "-", "-", str(r.get("error", "no result"))[:70]]
        lines.append([r["backend"], r["shape"], r["dtype"], str(r["batch"]), str(r["context"]), *cells])
    return lines


def tests_table(summary: list[dict[str, Any]]) -> list[list[str]]:
    lines = [["step", "status", "passed", "failed", "errors", "skipped", "procs", "s"]]
    for e in summary:
        lines.append([e["step"], e["status"], str(e["passed"]), str(e["failed"]), str(e["errors"]), str(e["skipped"]),
                      str(e["processes"]), f"{e['seconds']:.0f}"])
    return lines


def render_text(lines: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    out = []
    for n, row in enumerate(lines):
        out.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def render_md(lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(lines[0]) + " |", "|" + "---|" * len(lines[0])]
    out += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in lines[1:]]
    return "\n".join(out)




# ---------------------------------------------------------------------------------------------- end to end


def e2e_table(e2e: list[dict[str, Any]]) -> list[list[str]]:
    """Throughput of every system on the same requests, against transformers' continuous batching and ``generate``."""
    done = {r["system"]: r for r in e2e if r.get("tok_s")}
    cb, padded = done.get("hf generate_batch"), done.get("hf generate (padded)")
    lines = [["system", "requests", "done", "out tokens", "s", "tok/s", "x gen_batch", "x generate", "note"]]
    for r in e2e:
        tok_s = r.get("tok_s")
        lines.append([
            r["system"], str(r.get("requests", "-")), str(r.get("finished", "-")), str(r.get("output_tokens", "-")),
            _fmt(r.get("seconds"), ".1f"), _fmt(tok_s, ".0f"),
            _fmt(tok_s / cb["tok_s"] if tok_s and cb else None, ".2f"),
            _fmt(tok_s / padded["tok_s"] if tok_s and padded else None, ".2f"),
            str(r.get("note") or r.get("error") or "")[:90],
        ])
    return lines


def goals(points: list[dict[str, Any]], e2e: list[dict[str, Any]], shape: str, dtype: str) -> list[list[str]]:
    """The project's three goals, per paged backend, at the end-to-end model's attention shape."""
    lines = [["goal", "backend", "measured", "target", "verdict"]]
    main = [r for r in points if r["main"] and r["shape"] == shape and r["dtype"] == dtype
            and r["backend"] not in BASELINES]
    for r in main:
        timed = "median_us" in r
        why = "" if timed else f" ({str(r.get('error', 'no result'))[:50]})"
        pct, ratio = r.get("pct_copy"), r.get("x_contig")
        ok = r.get("ok", False)
        lines.append([f"decode attn b{r['batch']} ctx{r['context']} >= {GOAL_PCT:.0f}% copy bw", r["backend"],
                      _fmt(pct, ".1f") + "%" if pct is not None else "-" + why, f">= {GOAL_PCT:.0f}%",
                      _verdict(pct is not None and pct >= GOAL_PCT and ok, pct is not None, ok)])
        lines.append([f"paged / contiguous b{r['batch']} ctx{r['context']}", r["backend"],
                      _fmt(ratio, ".2f") + "x" if ratio is not None else "-" + why, f"<= {GOAL_RATIO:.2f}x",
                      _verdict(ratio is not None and ratio <= GOAL_RATIO and ok, ratio is not None, ok)])
    done = {r["system"]: r for r in e2e if r.get("tok_s")}
    cb = done.get("hf generate_batch")
    for r in e2e:
        if not r["system"].startswith("pagedkv"):
            continue
        x = r["tok_s"] / cb["tok_s"] if r.get("tok_s") and cb else None
        lines.append(["engine throughput vs generate_batch", r["system"].split("[")[-1].rstrip("]"),
                      _fmt(x, ".2f") + "x" if x is not None else "-", f">= {GOAL_SPEEDUP:.1f}x",
                      _verdict(x is not None and x >= GOAL_SPEEDUP and r.get("complete", False), x is not None,
                               r.get("complete", False), "partial run")])
    return lines


def _verdict(met: bool, measured: bool, ok: bool, bad: str = "WRONG RESULT") -> str:
    if not measured:
        return "not measured"
    if not ok:
        return bad
    return "met" if met else "MISSED"
