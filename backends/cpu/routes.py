"""Which phases the compiled kernel runs and which go to torch, per build: ``auto`` must never pick a path
slower than the torch reference for a phase on the machine it runs on.

The AVX-512 and AVX2 builds have register-tiled decode and prefill units; measured against the reference
(SmolLM2's shape, one thread, this AMD EPYC Zen 3 without AVX-512, load ~8): AVX2 prefill 1.4-1.5x faster,
decode ~10x; AVX-512 was tuned on its own machine (1.22x transformers at equal work). Those are kept by
their features. Any other build (plain x86-64, non-x86 ``-march=native``) is decided once by a
micro-benchmark against the reference, cached beside the library: on this machine the plain x86-64 build
decodes 3x faster than the reference but prefills ~0.6x, so its prefills go to torch.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch

from pagedkv.backends.cpu.route_table import KERNEL, TORCH, Routes

log = logging.getLogger("pagedkv")

FAST_BY_FEATURES = ("avx512", "avx2")
# Builds whose linear kernel (linear.h) is known to beat oneDNN: AVX2, measured on the Zen 3 at 1-512 rows
# (benchmarks/JOURNAL.md, 2026-12-01). Every other build, AVX-512 included, measures it once against oneDNN.
LINEAR_BY_FEATURES = ("avx2",)


def default_routes(lib) -> Routes:  # noqa: ANN001 - a ctypes library from build.load
    """The routes of a loaded build, cached beside its library (a library bound by hand runs the kernel)."""
    from pagedkv.backends.cpu import build

    isa = getattr(lib, "isa", None)  # (None: a library bound by hand, e.g. an older build for A/B runs)
    if isa is None:
        return Routes()
    return routes_for(lib, isa, build.library_path(isa).with_suffix(".routes.json"))


def routes_for(lib, isa: str, cache_file: Path | None) -> Routes:  # noqa: ANN001 - a ctypes library
    """The routes of the ``isa`` build: by features, else the cached (or a fresh) micro-benchmark."""
    attention_known, linear_known = isa in FAST_BY_FEATURES, isa in LINEAR_BY_FEATURES
    if attention_known and linear_known:
        return Routes()
    if cache_file is not None and cache_file.exists():
        try:
            return Routes(**json.loads(cache_file.read_text()))
        except (ValueError, TypeError):
            log.warning("pagedkv: ignoring an unreadable kernel route cache %s", cache_file)
    routes = measure(lib, attention=not attention_known, linear=not linear_known)
    log.info("pagedkv: the %s CPU kernel build runs decode by %s, prefill by %s, linears by %s (measured once)",
             isa, routes.decode, routes.prefill, routes.linear)
    if cache_file is not None:
        tmp = cache_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(routes)))
        tmp.replace(cache_file)
    return routes


def measure(lib, repeats: int = 3, attention: bool = True, linear: bool = True) -> Routes:  # noqa: ANN001
    """Kernel against reference, best of ``repeats`` (wall clock, alternating). Attention on a prefill
    (1 x 512 tokens) and a decode (16 x 256 context) of SmolLM2's attention shape (9 query heads, 3 KV heads,
    head dim 64); linears on 4 and 32 rows through 24 of SmolLM2's 1536 x 576 weights (85 MB: from memory, as
    in a step) against oneDNN (MKL without it). A phase not measured keeps the kernel."""
    verdict = {}
    if attention:
        verdict.update(_measure_attention(lib, repeats))
    if linear:
        verdict["linear"] = _measure_linear(lib, repeats)
    return Routes(**verdict)


def _measure_attention(lib, repeats: int) -> dict[str, str]:  # noqa: ANN001
    from pagedkv.backends.cpu.backend import CpuBackend
    from pagedkv.backends.torch_ref import TorchBackend

    kernel, ref = CpuBackend(lib, routes=Routes()), TorchBackend("cpu")
    verdict = {}
    for phase, lens, q_lens in (("prefill", [512], [512]), ("decode", [256] * 16, [1] * 16)):
        case = _case(lens, q_lens)
        kernel.attend(*case), ref.attend(*case)  # warm
        times = {"kernel": float("inf"), "torch": float("inf")}
        for _ in range(repeats):  # alternating, best of each: a neighbour's burst hits both alike
            times["kernel"] = min(times["kernel"], _seconds(kernel.attend, case))
            times["torch"] = min(times["torch"], _seconds(ref.attend, case))
        verdict[phase] = KERNEL if times["kernel"] <= times["torch"] else TORCH
    return verdict


def _measure_linear(lib, repeats: int) -> str:  # noqa: ANN001
    from pagedkv.backends.cpu.linear import CpuLinearKernel, usable
    from pagedkv.core.model import cpu_linear

    if not usable(lib):
        return TORCH
    kernel = CpuLinearKernel(lib)
    weights = [torch.full((1536, 576), 0.01) for _ in range(24)]
    ours = [kernel.pack(w) for w in weights]
    onednn = [cpu_linear.onednn_pack(w) for w in weights] if cpu_linear.available() else None

    def run_ours(x: torch.Tensor) -> None:
        for pack in ours:
            kernel.linear(x, pack, None, 1536)

    def run_torch(x: torch.Tensor) -> None:
        for w, pack in zip(weights, onednn or weights):
            if onednn is None:
                torch.nn.functional.linear(x, w)
            else:
                torch.ops.mkldnn._linear_pointwise(x, pack, None, "none", [], "")

    for rows in (4, 32):
        x = torch.full((rows, 576), 0.5)
        run_ours(x), run_torch(x)  # warm
        best_ours = min(_seconds(run_ours, (x,)) for _ in range(repeats))
        best_torch = min(_seconds(run_torch, (x,)) for _ in range(repeats))
        if best_ours > best_torch:
            return TORCH
    return KERNEL


def _seconds(fn, args) -> float:  # noqa: ANN001
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def _case(lens: list[int], q_lens: list[int]) -> tuple:
    from pagedkv.core.kv.attention_metadata import AttentionMetadata

    block, heads, kv_heads, dim = 16, 9, 3, 64
    gen = torch.Generator().manual_seed(0)
    tables, first = [], 0
    for n in lens:
        count = -(-n // block)
        tables.append(list(range(first, first + count)))
        first += count
    k_cache = torch.randn(first, block, kv_heads, dim, generator=gen)
    v_cache = torch.randn(first, block, kv_heads, dim, generator=gen)
    query = torch.randn(sum(q_lens), heads, dim, generator=gen)
    meta = AttentionMetadata.build(block_tables=tables, context_lens=[n - q for n, q in zip(lens, q_lens)],
                                   query_lens=q_lens, block_size=block)
    return query, k_cache, v_cache, meta, dim**-0.5
