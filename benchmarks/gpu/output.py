"""What comes back from the device: ``gpu_suite.md``, ``gpu_suite.json`` and ``logs.tar.gz`` in ``$OUT``
(the device tool returns at most 8 files), rewritten after every phase, and the tables printed last.

Each file is written to a temporary name and renamed, so a kill at any moment leaves the previous complete
version; the tool returns only the last 12,000 characters of output, so the most important table is printed last.
"""

from __future__ import annotations

import json
import os
import tarfile
import time
from pathlib import Path
from typing import Any

from gpu.report import (
    GOAL_PCT,
    GOAL_RATIO,
    GOAL_SPEEDUP,
    bench_table,
    combine,
    e2e_table,
    goals,
    render_md,
    render_text,
    tests_table,
)

STDOUT_LIMIT = 11_000  # of the tool's 12,000 returned characters, leaving room for a traceback line or two


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _tar_logs(out_dir: Path, work_dir: Path) -> None:
    tmp = out_dir / ".logs.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for sub in ("logs", "junit"):
            if (work_dir / sub).is_dir():
                tar.add(work_dir / sub, arcname=sub)
    os.replace(tmp, out_dir / "logs.tar.gz")


def _sections(state: dict[str, Any]) -> dict[str, Any]:
    env, copy_gbps, points = combine(state["rows"])
    shape, dtype = state["e2e_attention_point"]
    header = (f"gpu: {env.get('gpu', env.get('device', '?'))}; torch {env.get('torch')}, triton {env.get('triton')}, "
              f"cupy {env.get('cupy')}, transformers {env.get('transformers')}; copy bandwidth (read+write) "
              f"{copy_gbps:.0f} GB/s" if copy_gbps else f"gpu: {env.get('gpu', '?')} (no copy bandwidth measured)")
    if state["dry_run"]:
        header += " [DRY RUN: CPU, perf_counter, tiny shapes]"
    return {
        "env": env, "copy_gbps": copy_gbps, "points": points, "header": header,
        "goals": goals(points, state["e2e"], shape, dtype),
        "e2e": e2e_table(state["e2e"]) if state["e2e"] else None,
        "kernels": bench_table(points) if points else None,
        "tests": tests_table(state["tests"]) if state["tests"] else None,
    }


def _status(state: dict[str, Any]) -> str:
    if state["complete"]:
        return f"complete in {state['wall_s']:.0f}s of a {state['budget_s']:.0f}s budget"
    return f"PARTIAL: written during '{state['phase']}' at {state['wall_s']:.0f}s of a {state['budget_s']:.0f}s budget"


def write_outputs(out_dir: Path, work_dir: Path, state: dict[str, Any]) -> None:
    """Rewrite the three files from everything finished so far."""
    sec = _sections(state)
    md = [f"# gpu_suite results ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "", sec["header"], "",
          f"Status: {_status(state)}.", "", "## Goals", "", render_md(sec["goals"]), "",
          f"Goals: decode attention >= {GOAL_PCT:.0f}% of copy bandwidth and <= {GOAL_RATIO:.2f}x contiguous "
          f"attention (the faster of SDPA and flash-only SDPA) at batch 64, context 2048, the end-to-end model's "
          f"heads ({state['e2e_attention_point'][0]}, {state['e2e_attention_point'][1]}); "
          f"engine >= {GOAL_SPEEDUP:.0f}x transformers generate_batch throughput.", ""]
    if sec["e2e"]:
        md += ["## End to end", "", *state["e2e_notes"], "", render_md(sec["e2e"]), ""]
    md += [f"Tensor parallel: {r.get('note') or r.get('error')}" for r in state["tp"]]
    if sec["kernels"]:
        md += ["", "## Decode attention", "", render_md(sec["kernels"]), ""]
    if sec["tests"]:
        md += ["## Correctness", "", render_md(sec["tests"]), ""]
        for e in state["tests"]:
            md += [f"- {e['step']}: {line}" for line in e["failing"][:20]]
    md += ["", f"Workers: {json.dumps(state['workers'])}", ""]
    _atomic_write(out_dir / "gpu_suite.md", "\n".join(md).encode())
    payload = {k: state[k] for k in ("dry_run", "budget_s", "wall_s", "complete", "phase", "tests", "workers", "e2e",
                                     "tp", "e2e_notes")}
    payload.update(env=sec["env"], copy_gbps=sec["copy_gbps"], points=sec["points"])
    _atomic_write(out_dir / "gpu_suite.json", json.dumps(payload, indent=1, default=str).encode())
    _tar_logs(out_dir, work_dir)


def final_text(state: dict[str, Any], out_dir: Path) -> str:
    """Everything worth reading, least important first; the kernel table loses its extra points if too long."""
    sec = _sections(state)
    parts = [f"workers: {json.dumps(state['workers'])}"]
    failing = [f"  {e['step']}: {line}"[:160] for e in state["tests"] for line in e["failing"][:6]]
    parts += failing[:30] + ([f"  ... {len(failing) - 30} more in gpu_suite.md"] if len(failing) > 30 else [])
    if sec["tests"]:
        parts.append(render_text(sec["tests"]))
    tail = []
    if sec["e2e"]:
        tail += ["", *state["e2e_notes"], render_text(sec["e2e"])]
    tail += [f"tensor parallel: {r.get('note') or r.get('error')}" for r in state["tp"]]
    tail += ["", sec["header"], render_text(sec["goals"]), "",
             f"{_status(state)}; full report: {out_dir / 'gpu_suite.md'}, gpu_suite.json, logs.tar.gz"]
    kernels = sec["kernels"]
    if kernels:
        text = render_text(kernels)
        room = STDOUT_LIMIT - len("\n".join(parts + tail)) - 200
        if len(text) > room:
            kept = [kernels[0]] + [row for row, p in zip(kernels[1:], sec["points"]) if p["main"]]
            text = render_text(kept) + "\n(extra points: see gpu_suite.md)"
        parts += ["", text]
    out = "\n".join(parts + tail)
    return out[-STDOUT_LIMIT:]
