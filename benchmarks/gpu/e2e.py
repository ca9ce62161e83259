"""The two end-to-end workers: a token-exact check of a tiny Llama (correctness phase) and the throughput
comparison with transformers (benchmark phase), each in a process of its own."""

from __future__ import annotations

import copy
import dataclasses
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from gpu.rows import emit
from gpu.runner import REPO
from gpu.throughput import (
    ATTENTION_POINT,
    LLAMA_1B,
    TINY,
    build_model,
    make_requests,
    run_hf_generate,
    run_hf_generate_batch,
    run_pagedkv,
)

TP_REASON = "tensor parallelism not implemented yet"


def check_worker(rows: Path, device: str, backends: list[str]) -> int:
    """Tiny random Llama, fp32: the engine's greedy tokens on ``device`` for each backend vs transformers."""
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import _tiny_llama, hf_greedy, random_prompts
    from pagedkv import LLM, SamplingParams

    prompts = random_prompts([3, 17, 40, 1, 64, 9], seed=1)
    model = _tiny_llama()
    want = [hf_greedy(model, p, 16) for p in prompts]
    for backend in backends:
        name = f"e2e[{backend}-{device}]"
        try:
            llm = LLM(hf_model=copy.deepcopy(model), device=device, backend=backend, dtype="float32", block_size=16,
                      num_blocks=256)
            got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))]
            if got == want:
                emit(rows, {"name": name, "status": "pass"})
            else:
                bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
                emit(rows, {"name": name, "status": "fail", "detail": f"tokens differ for prompts {bad}"})
        except Exception as exc:  # noqa: BLE001 - every backend is checked even if one cannot run
            emit(rows, {"name": name, "status": "error", "detail": f"{type(exc).__name__}: {exc}"[:500]})
            traceback.print_exc()
    return 0


def throughput_worker(rows: Path, deadline: float, dry_run: bool, backends: list[str], num_requests: int,
                      scale: float) -> int:
    """Every system on the same requests, in an order that gets the goal's numbers first: the fastest
    expected pagedkv backend, then ``generate_batch`` (the goal's baseline), then the rest."""
    import torch

    device, dtype = ("cpu", torch.bfloat16) if dry_run else ("cuda", torch.bfloat16)
    dims = TINY if dry_run else LLAMA_1B
    if dry_run:
        reqs = make_requests(min(num_requests, 6), scale, max_prompt=24, max_output=8, vocab=dims["vocab_size"])
    else:
        reqs = make_requests(num_requests, scale, max_prompt=1024, max_output=512, vocab=dims["vocab_size"])
    shape, kdtype = ATTENTION_POINT["dry" if dry_run else "gpu"]
    emit(rows, {"kind": "e2e_info", "model": dims, "dtype": "bfloat16", "device": device, "requests": len(reqs.prompts),
                "prompt_tokens": sum(map(len, reqs.prompts)), "output_tokens": reqs.output_tokens,
                "max_prompt": max(map(len, reqs.prompts)), "max_output": max(reqs.outputs), "scale": scale,
                "attention_point": [shape, kdtype]})
    base = build_model(torch, dims, device, dtype)
    paged = [b for b in ("triton", "cupy", "torch") if b in backends and (b == "torch" or not dry_run)]
    systems: list[tuple[str, Any]] = []
    for name in paged[:1] + ["hf generate_batch"] + paged[1:2] + ["hf generate (padded)"] + paged[2:]:
        if name.startswith("hf generate_batch"):
            systems.append((name, lambda m, d: run_hf_generate_batch(torch, m, reqs, d, device, dry_run)))
        elif name.startswith("hf generate"):
            systems.append((name, lambda m, d: run_hf_generate(torch, m, reqs, d, device)))
        else:
            systems.append((f"pagedkv[{name}]", lambda m, d, b=name: run_pagedkv(torch, m, reqs, d, b, device,
                                                                                 "bfloat16")))
    for i, (name, run) in enumerate(systems):
        share = (deadline - time.time()) / (len(systems) - i)
        row: dict[str, Any] = {"kind": "e2e", "system": name, "requests": len(reqs.prompts)}
        if share < (1 if dry_run else 8):
            emit(rows, {**row, "error": f"skipped: out of time ({share:.0f}s left for it)"})
            continue
        emit(rows, _timed(torch, run, base, time.time() + share, reqs, row, device))
    emit(rows, tensor_parallel_point(torch, base, reqs, deadline, device))
    return 0


def _timed(torch: Any, run: Any, base: Any, until: float, reqs: Any, row: dict[str, Any], device: str) -> dict:
    model = None
    try:
        model = copy.deepcopy(base)
        got = run(model, until)
        row.update(got)
        row["complete"] = got["finished"] == len(reqs.prompts)
        row["tok_s"] = got["output_tokens"] / got["seconds"] if got["seconds"] > 0 else None
        if not row["complete"]:
            row["note"] = f"PARTIAL: stopped at its time share; {row.get('note', '')}".rstrip("; ")
    except Exception as exc:  # noqa: BLE001 - recorded; the next system still runs
        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        traceback.print_exc()
    finally:
        del model
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return row


def tensor_parallel_point(torch: Any, base: Any, reqs: Any, deadline: float, device: str) -> dict[str, Any]:
    """N=1 against N=all GPUs, once ``EngineConfig`` has ``tensor_parallel_size``; a reasoned skip until then."""
    from pagedkv.core.config import EngineConfig

    row: dict[str, Any] = {"kind": "tp"}
    if "tensor_parallel_size" not in {f.name for f in dataclasses.fields(EngineConfig)}:
        return {**row, "note": f"skipped: {TP_REASON}"}
    count = torch.cuda.device_count() if device.startswith("cuda") else 0
    if count < 2:
        return {**row, "note": f"skipped: N=all needs at least 2 GPUs, this machine has {count}"}
    for n in (1, count):
        share = (deadline - time.time()) / (2 if n == 1 else 1)
        if share < 8:
            return {**row, "note": f"skipped: out of time at N={n}"}
        got = _timed(torch, lambda m, d, n=n: run_pagedkv(torch, m, reqs, d, "triton", device, "bfloat16",
                                                          tensor_parallel_size=n), base, time.time() + share, reqs,
                     {}, device)
        row[f"tok_s_n{n}"] = got.get("tok_s")
        row[f"error_n{n}"] = got.get("error")
    row["note"] = f"N=1 {row.get('tok_s_n1')} tok/s, N={count} {row.get(f'tok_s_n{count}')} tok/s"
    return row
