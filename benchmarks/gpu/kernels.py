"""Decode-attention timings, one backend per process: paged backends against SDPA on the same K/V laid out
contiguously, bandwidth against a measured device copy."""

from __future__ import annotations

import contextlib
import importlib.metadata
import platform
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

from gpu.rows import emit

BLOCK_SIZE = 16
# (q heads, kv heads, head_dim): SmolLM2-135M, Llama-3.2-1B, Llama-3.1-8B
GPU_SHAPES = {"smollm2": (9, 3, 64), "llama1b": (32, 8, 64), "llama8b": (32, 8, 128)}
DRY_SHAPES = {"tiny": (4, 2, 16)}
MAIN_POINT = (64, 2048)
EXTRA_POINTS = [(1, 2048), (16, 2048), (256, 2048), (64, 512), (64, 8192), (1, 8192)]
# max |out - fp32 SDPA| accepted at a timing point (a sanity check; the test files hold the real tolerances)
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 6e-2}
REF_SEQS = 8  # sequences of each timing point checked against fp32
COPY_BYTES = 1 << 30
FLUSH_BYTES = 256 << 20


def plan_points(dry_run: bool, extras: bool) -> list[dict[str, Any]]:
    points = []
    if dry_run:
        main_dtypes, shapes = ("float32", "bfloat16"), DRY_SHAPES
        main, extra = [(2, 64)], [(3, 40)]
    else:
        main_dtypes, shapes = ("float16", "bfloat16"), GPU_SHAPES
        main, extra = [MAIN_POINT], EXTRA_POINTS
    for dtype in main_dtypes:
        for shape, (h, hkv, d) in shapes.items():
            for b, ctx in main:
                points.append(dict(shape=shape, heads=h, kv_heads=hkv, head_dim=d, dtype=dtype, batch=b, context=ctx,
                                   main=True))
    if extras:
        for b, ctx in extra:
            for shape, (h, hkv, d) in shapes.items():
                points.append(dict(shape=shape, heads=h, kv_heads=hkv, head_dim=d, dtype=main_dtypes[0], batch=b,
                                   context=ctx, main=False))
    return points


def point_bytes(p: dict[str, Any]) -> int:
    es = 4 if p["dtype"] == "float32" else 2
    kv = 2 * p["batch"] * p["context"] * p["kv_heads"] * p["head_dim"] * es
    qo = 2 * p["batch"] * p["heads"] * p["head_dim"] * es
    return kv + qo


class Timer:
    """Per-call times in µs: CUDA events on a GPU, perf_counter (after a sync) on the CPU."""

    def __init__(self, torch: Any, device: Any, flush_bytes: int) -> None:
        self.torch = torch
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(flush_bytes, dtype=torch.uint8, device=device) if flush_bytes else None

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def per_call(self, fn: Any, reps: int, flush: bool = True) -> list[float]:
        flush = flush and self.flush is not None
        if self.cuda:
            ev = [(self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True))
                  for _ in range(reps)]
            for start, end in ev:
                if flush:
                    self.flush.zero_()
                start.record()
                fn()
                end.record()
            self.sync()
            return [start.elapsed_time(end) * 1e3 for start, end in ev]
        out = []
        for _ in range(reps):
            if flush:
                self.flush.zero_()
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
        return out

    def loop(self, fn: Any, reps: int) -> float:
        """Mean µs of ``reps`` back-to-back calls (no flush: launch overhead shows when kernels are short)."""
        self.sync()
        if self.cuda:
            start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            self.sync()
            return start.elapsed_time(end) * 1e3 / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e6 / reps


def measure(timer: Timer, fn: Any, budget_s: float, min_reps: int, max_reps: int, flush: bool = True) -> dict:
    for _ in range(3):
        fn()
    timer.sync()
    probe = statistics.median(timer.per_call(fn, 3, flush))
    reps = int(min(max_reps, max(min_reps, budget_s * 1e6 / max(probe, 1.0))))
    samples = timer.per_call(fn, reps, flush)
    return {
        "median_us": statistics.median(samples),
        "min_us": min(samples),
        "max_us": max(samples),
        "loop_us": timer.loop(fn, reps),
        "reps": reps,
    }


def make_backend(name: str, device: Any, dtype: Any) -> Any:
    from types import SimpleNamespace

    config = SimpleNamespace(device=str(device), dtype=dtype, block_size=BLOCK_SIZE)
    if name == "torch":
        from pagedkv.backends.torch_ref import TorchBackend

        return TorchBackend(device)
    if name == "triton":
        from pagedkv.backends.triton.backend import TritonBackend

        return TritonBackend(config)
    if name == "cupy":
        from pagedkv.backends.cupy.backend import CupyBackend

        return CupyBackend(config)
    raise ValueError(f"unknown backend {name!r}")


def build_case(torch: Any, p: dict[str, Any], device: Any, seed: int = 1234) -> dict[str, Any]:
    """The same data in every worker: a shuffled paged cache and its contiguous copy for the baseline."""
    from pagedkv.core.kv.attention_metadata import AttentionMetadata

    dtype = getattr(torch, p["dtype"])
    b, ctx, h, hkv, d = p["batch"], p["context"], p["heads"], p["kv_heads"], p["head_dim"]
    per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = b * per_seq + 1
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    tables = perm[: b * per_seq].view(b, per_seq)
    gen = torch.Generator(device=device).manual_seed(seed)
    k_cache = torch.randn((num_blocks, BLOCK_SIZE, hkv, d), generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn((num_blocks, BLOCK_SIZE, hkv, d), generator=gen, device=device, dtype=dtype)
    query = torch.randn((b, h, d), generator=gen, device=device, dtype=dtype)
    meta = AttentionMetadata.build(block_tables=tables.tolist(), context_lens=[ctx - 1] * b, query_lens=[1] * b,
                                   block_size=BLOCK_SIZE, device=device)
    return {"tables": tables.to(device), "k_cache": k_cache, "v_cache": v_cache, "query": query, "meta": meta,
            "scale": d ** -0.5}


def contiguous_kv(case: dict[str, Any], p: dict[str, Any], seqs: int | None = None) -> tuple[Any, Any]:
    """``[B, Hkv, L, D]`` contiguous K and V of each sequence (of the first ``seqs`` ones)."""
    ctx = p["context"]
    tables = case["tables"][:seqs].long()

    def lay(cache: Any) -> Any:
        rows = cache[tables].reshape(tables.shape[0], -1, p["kv_heads"], p["head_dim"])[:, :ctx]
        return rows.permute(0, 2, 1, 3).contiguous()

    return lay(case["k_cache"]), lay(case["v_cache"])


def sdpa_decode(torch: Any, q: Any, k: Any, v: Any, scale: float) -> Any:
    out = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)
    return out.squeeze(2)


def env_info(torch: Any, device: Any) -> dict[str, Any]:
    info: dict[str, Any] = {"kind": "env", "python": platform.python_version(), "torch": torch.__version__,
                            "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda, l2_mib=round(getattr(props, "L2_cache_size", 0) / 2**20, 1))
    for name, dists in (("triton", ["triton"]), ("cupy", ["cupy-cuda13x", "cupy-cuda12x", "cupy"]),
                        ("transformers", ["transformers"])):
        info[name] = None  # versions from the installed metadata: importing them here would cost seconds
        for dist in dists:
            try:
                info[name] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return info


def _flash_only(torch: Any) -> Any:
    """A context that lets SDPA use only its FlashAttention kernel (the contiguous baseline a serving stack
    would use); None where this torch has no such switch."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def _point_fn(torch: Any, name: str, case: dict[str, Any], p: dict[str, Any], backends: dict[str, Any],
              device: Any) -> Any:
    """The call to time: SDPA on contiguous K/V (``sdpa``, ``sdpa_flash``) or a paged backend's ``attend``."""
    if name in ("sdpa", "sdpa_flash"):  # sdpa_flash: the caller holds the flash-only context around the timing
        kc, vc = contiguous_kv(case, p)
        q, scale = case["query"], case["scale"]
        return lambda: sdpa_decode(torch, q, kc, vc, scale)
    if p["dtype"] not in backends:
        try:
            backends[p["dtype"]] = make_backend(name, device, getattr(torch, p["dtype"]))
        except Exception as exc:  # noqa: BLE001 - recorded, and the next dtype is tried
            backends[p["dtype"]] = exc
    backend = backends[p["dtype"]]
    if isinstance(backend, Exception):
        raise RuntimeError(f"backend construction failed: {type(backend).__name__}: {backend}")
    return lambda: backend.attend(case["query"], case["k_cache"], case["v_cache"], case["meta"], case["scale"])


def _time_point(torch: Any, name: str, p: dict[str, Any], case: dict[str, Any], ref: Any, timer: Timer,
                backends: dict[str, Any], device: Any) -> dict[str, Any]:
    key = {k: p[k] for k in ("shape", "heads", "kv_heads", "head_dim", "dtype", "batch", "context", "main")}
    row: dict[str, Any] = {"kind": "point", "backend": name, **key, "bytes": point_bytes(p)}
    try:
        fn = _point_fn(torch, name, case, p, backends, device)
        out = fn()[:REF_SEQS]
        timer.sync()
        row["max_err"] = float((out.float() - ref).abs().max().item()) if out.shape == ref.shape else float("nan")
        row["tol"] = TOLERANCE[p["dtype"]]
        finite = out.shape == ref.shape and bool(torch.isfinite(out).all().item())
        row["ok"] = bool(finite and row["max_err"] <= row["tol"])
        del out
        budget, lo, hi = (0.4, 10, 200) if p["main"] else (0.15, 5, 100)
        row.update(measure(timer, fn, budget, lo, hi))
    except Exception as exc:  # noqa: BLE001 - recorded; the next point runs if the device still works
        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        traceback.print_exc()
    return row


def bench_worker(name: str, rows: Path, deadline: float, dry_run: bool, extras: bool) -> int:
    """Time every point of one backend (``sdpa`` also measures the copy bandwidth and the flash-only SDPA)."""
    import torch

    device = torch.device("cpu" if dry_run else "cuda")
    timer = Timer(torch, device, 0 if dry_run else FLUSH_BYTES)
    variants = [name]
    if name == "sdpa":
        emit(rows, env_info(torch, device))
        nbytes = (16 << 20) if dry_run else COPY_BYTES
        src = torch.ones(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        m = measure(timer, lambda: dst.copy_(src), 0.3, 10, 100, flush=False)
        emit(rows, {"kind": "copy", "bytes": nbytes, **m, "gbps": 2 * nbytes / m["median_us"] / 1e3})
        del src, dst
        if device.type == "cuda" and _flash_only(torch) is not None:
            variants.append("sdpa_flash")
    backends: dict[str, Any] = {}
    for p in plan_points(dry_run, extras):
        if time.time() > deadline:
            for v in variants:
                emit(rows, {"kind": "point", "backend": v, "shape": p["shape"], "dtype": p["dtype"],
                            "batch": p["batch"], "context": p["context"], "main": p["main"],
                            "error": "skipped: the worker ran out of time"})
            continue
        case = ref = None
        try:
            case = build_case(torch, p, device)
            # fp32 reference on the first few sequences only: an fp32 GQA SDPA of a whole big point would take
            # the math path, which expands K/V per query head (tens of GB at batch 256, context 8k)
            kc, vc = contiguous_kv(case, p, REF_SEQS)
            ref = sdpa_decode(torch, case["query"][:REF_SEQS].float(), kc.float(), vc.float(), case["scale"])
            del kc, vc
            for v in variants:
                with _flash_only(torch) if v == "sdpa_flash" else contextlib.nullcontext():
                    emit(rows, _time_point(torch, v, p, case, ref, timer, backends, device))
        except Exception as exc:  # noqa: BLE001 - the point's data could not be built
            emit(rows, {"kind": "point", "backend": name, "shape": p["shape"], "dtype": p["dtype"],
                        "batch": p["batch"], "context": p["context"], "main": p["main"],
                        "error": f"{type(exc).__name__}: {exc}"[:500]})
            traceback.print_exc()
        finally:
            case = ref = None
        if device.type == "cuda":
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception as fatal:  # noqa: BLE001
                emit(rows, {"kind": "fatal", "backend": name, "error": f"CUDA context lost: {fatal}"[:500]})
                return 3
    return 0
