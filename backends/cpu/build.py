"""Compile the CPU kernel library (``SOURCES``: one translation unit per entry family) once per machine and
instruction set into the cache directory and load it with ctypes.

The kernel has a plain C interface, so it needs only a C++ compiler with OpenMP:
no Python headers, no pybind11, no ninja, and a build takes a few seconds
(``torch.utils.cpp_extension`` with ``torch/extension.h`` takes many times longer).
On x86 it is built once per instruction set with an explicit ``-march``
(``x86-64-v4`` = AVX-512, ``x86-64-v3`` = AVX2+FMA, plain ``x86-64``), and the
best one this CPU runs is loaded (chosen from its feature flags, as vLLM's and
llama.cpp's CPU builds choose theirs). Any variant can be built and, where the
CPU has the instructions, loaded on any machine, so the kernel tests cover every
path a user's CPU could take. Elsewhere there is one ``-march=native`` build.
The cache key includes the flags, the source and the CPU's feature flags
(``-mtune=native``): a cache shared between machines never hands one CPU another's binary.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from functools import cache
from pathlib import Path

log = logging.getLogger("pagedkv")

SOURCE_DIR = Path(__file__).resolve().parent
# One translation unit per entry family, linked into one library: attend/decode/prefill, the KV write, the linears
# (fp32, bf16 and GGUF-block weights), the fused Llama layer. Each includes only the headers it uses.
SOURCES = ("attention.cpp", "kv_write.cpp", "linear.cpp", "llama_layer.cpp")
# Per-unit flags (GCC's): attention.cpp alone is a smaller unit than the old all-in-one file, and GCC's default
# inlining budget then left the decode's score-tree leaves out of line (bf16 decode 0.93x); with 80% growth they
# inline and decode is 1.00x fp32, 1.07x bf16, 1.18x int8 against the all-in-one build (JOURNAL, 2026-12-04).
UNIT_FLAGS = {"attention.cpp": ("--param", "inline-unit-growth=80")}
# included by SOURCES: part of the cache key
HEADERS = ("simd.h", "numerics.h", "paged.h", "general.h", "decode.h", "prefill.h", "decode_int8.h", "linear.h",
           "llama_block.h", "quant_blocks.h", "quant_packed.h", "quant_linear.h", "quant_int8.h")
FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-std=c++17")
# Instruction set -> (-march flags, /proc/cpuinfo flags the CPU needs to run the build), best first.
_AVX512 = frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "bmi2"})
_AVX2 = frozenset({"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm", "xsave"})
X86_VARIANTS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    # the avx512 build plus vdpbf16ps for bf16 weights and vpdpbusd for GGUF blocks (Zen 4 and later, Cooper Lake,
    # Sapphire Rapids and later: every CPU with avx512_bf16 has avx512_vnni); the plain avx512 build (Skylake-X,
    # Ice Lake without bf16) takes GGUF blocks by vpmaddubsw
    "avx512-bf16": (("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mtune=native"),
                    _AVX512 | {"avx512_bf16", "avx512_vnni"}),
    "avx512": (("-march=x86-64-v4", "-mtune=native"), _AVX512),
    # the avx2 build plus the VEX vpdpbusd for GGUF blocks (Alder Lake and later, Zen 5)
    "avx2-vnni": (("-march=x86-64-v3", "-mavxvnni", "-mtune=native"), _AVX2 | {"avx_vnni"}),
    "avx2": (("-march=x86-64-v3", "-mtune=native"), _AVX2),
    "generic": (("-march=x86-64", "-mtune=native"), frozenset()),
}
# Test builds, never loaded for serving: "avx512-shape" is the AVX-512 build's widths and register tiles
# emitted as AVX2 instructions (simd.h), so the kernel tests run the AVX-512 build's loops on AVX2 machines.
CHECK_VARIANTS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "avx512-shape": (("-march=x86-64-v3", "-mtune=native", "-DPAGEDKV_AVX512_SHAPE"), X86_VARIANTS["avx2"][1]),
}
# what pagedkv_cpu_lanes() of each build returns
LANES = {"avx512-bf16": 16, "avx512": 16, "avx2": 8, "avx2-vnni": 8, "generic": 4, "avx512-shape": 16}


class BuildError(RuntimeError):
    """No usable compiled kernel: no compiler, a failed build, or a library that does not load."""


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def variants() -> tuple[str, ...]:
    """The builds this platform has, best first (``native`` off x86)."""
    return tuple(X86_VARIANTS) if is_x86() else ("native",)


def checked_variants() -> tuple[str, ...]:
    """The builds the kernel tests run where the CPU allows: every build, and on x86 the test builds."""
    return (*variants(), *CHECK_VARIANTS) if is_x86() else variants()


def required_flags(isa: str) -> frozenset[str]:
    """The /proc/cpuinfo flags a CPU needs to run the ``isa`` build (x86 builds only)."""
    return {**X86_VARIANTS, **CHECK_VARIANTS}[isa][1]


def runnable(isa: str, cpu_flags: str | None = None) -> bool:
    """Whether this CPU (or one with ``cpu_flags``) executes the ``isa`` build."""
    if isa == "native":
        return not is_x86()
    flags = set((_cpu_flags() if cpu_flags is None else cpu_flags).split())
    return is_x86() and required_flags(isa) <= flags


def best_isa(cpu_flags: str | None = None) -> str:
    """The fastest build this CPU runs; ``$PAGEDKV_CPU_ISA`` overrides it (one that the CPU cannot run fails)."""
    forced = os.environ.get("PAGEDKV_CPU_ISA")
    if forced:
        if forced not in variants() or not runnable(forced, cpu_flags):
            raise BuildError(f"PAGEDKV_CPU_ISA={forced!r}: this CPU runs {[v for v in variants() if runnable(v)]}")
        return forced
    return next(v for v in variants() if runnable(v, cpu_flags))


def march(isa: str) -> tuple[str, ...]:
    return ("-march=native",) if isa == "native" else {**X86_VARIANTS, **CHECK_VARIANTS}[isa][0]


def compiler() -> str | None:
    """The C++ compiler to use: ``$CXX`` or ``g++``/``c++`` on PATH (None: there is none)."""
    name = os.environ.get("CXX")
    if name:
        return shutil.which(name)
    return shutil.which("g++") or shutil.which("c++")


def library_path(isa: str | None = None) -> Path:
    """Where the ``isa`` build (default: the best for this CPU) of this source, these flags and this CPU lives."""
    from pagedkv.core.model.model_loader import cache_dir

    isa = isa or best_isa()
    key = hashlib.sha256()
    sources = [(SOURCE_DIR / name).read_bytes() for name in (*SOURCES, *HEADERS)]
    flags = " ".join((*FLAGS, *march(isa), *(f for unit in UNIT_FLAGS.values() for f in unit)))
    for part in (*sources, flags.encode(), platform.machine().encode(), _cpu_flags().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / "cpu_attention" / f"pagedkv_cpu_attention_{isa}_{key.hexdigest()[:16]}.so"


def compile_library(target: Path, isa: str) -> float:
    """Build the ``isa`` variant into ``target`` (whether or not this CPU runs it); seconds taken."""
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (set CXX or install g++)")
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        # The translation units compile side by side (attention.cpp, the largest, sets the wall time), then link.
        objects = [str(Path(tmp) / f"{Path(name).stem}.o") for name in SOURCES]
        unit_flags = UNIT_FLAGS if _is_gcc(cxx) else {}
        procs = [subprocess.Popen([cxx, *FLAGS, *march(isa), *unit_flags.get(name, ()), "-c", str(SOURCE_DIR / name),
                                   "-o", obj],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for name, obj in zip(SOURCES, objects)]
        for proc, (_, stderr) in zip(procs, _wait_saying_so(procs)):
            if proc.returncode != 0:
                raise BuildError(f"{cxx} failed: {stderr.strip()[-2000:]}")
        out = Path(tmp) / target.name
        link = subprocess.run([cxx, *FLAGS, *march(isa), *objects, "-o", str(out)], capture_output=True, text=True)
        if link.returncode != 0:
            raise BuildError(f"{cxx} failed to link: {link.stderr.strip()[-2000:]}")
        os.replace(out, target)  # atomic: a concurrent build never sees a half-written library
    return time.perf_counter() - started


@cache
def _is_gcc(cxx: str) -> bool:
    """Whether ``cxx`` is GCC (whose ``--param`` names UNIT_FLAGS uses; clang has other ones)."""
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    return "clang" not in out.lower()


_MESSAGE = "pagedkv: compiling the CPU attention kernel (once per machine)"


def _wait_saying_so(procs: list[subprocess.Popen]) -> list[tuple[str, str]]:
    """The builds' outputs, after saying on stderr what the wait is for (with a spinner on a terminal)."""
    stream = sys.stderr
    if not (hasattr(stream, "isatty") and stream.isatty()):
        print(f"{_MESSAGE}...", file=stream, flush=True)
        return [proc.communicate() for proc in procs]
    frames, index, started = "|/-\\", 0, time.perf_counter()
    results = []
    for proc in procs:
        while True:
            try:
                results.append(proc.communicate(timeout=0.2))
                break
            except subprocess.TimeoutExpired:
                stream.write(f"\r{_MESSAGE} {frames[index % 4]} {time.perf_counter() - started:4.0f} s")
                stream.flush()
                index += 1
    stream.write(f"\r{_MESSAGE}: done in {time.perf_counter() - started:.0f} s\n")
    stream.flush()
    return results


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.pagedkv_cpu_attend.argtypes = [
        i32, p, i64, i64, p, p, p, p, i64, p, p, i32, i32, i32, i32, i32, f32, i32, f32, i32, i32, i32,
    ]
    lib.pagedkv_cpu_attend.restype = i32
    if hasattr(lib, "pagedkv_cpu_lanes"):  # (a library built from an older source, for A/B runs, has neither)
        lib.pagedkv_cpu_lanes.argtypes = []
        lib.pagedkv_cpu_lanes.restype = i32
        lib.pagedkv_cpu_isa.argtypes = []
        lib.pagedkv_cpu_isa.restype = ctypes.c_char_p
    if hasattr(lib, "pagedkv_cpu_decode_int8"):  # (absent from libraries built before the int8 cache)
        lib.pagedkv_cpu_decode_int8.argtypes = [
            p, i64, i64, p, p, p, p, i64, p, i32, i32, i32, i32, i32, f32, i32, f32, i32,
        ]
        lib.pagedkv_cpu_decode_int8.restype = i32
    if hasattr(lib, "pagedkv_cpu_write_kv"):  # (absent from libraries built before it)
        lib.pagedkv_cpu_write_kv.argtypes = [i32, p, i64, p, i64, p, p, p, i64, i64, i64]
        lib.pagedkv_cpu_write_kv.restype = i32
    if hasattr(lib, "pagedkv_cpu_linear"):  # (absent from libraries built before the packed linear)
        lib.pagedkv_cpu_linear_panel.argtypes = []
        lib.pagedkv_cpu_linear_panel.restype = i32
        lib.pagedkv_cpu_linear.argtypes = [p, i64, i64, p, p, i64, p, i32]
        lib.pagedkv_cpu_linear.restype = i32
    if hasattr(lib, "pagedkv_cpu_linear_bf16"):  # (absent from libraries built before the bf16 weights)
        lib.pagedkv_cpu_linear_bf16.argtypes = [p, i64, i64, p, p, i64, p, i32]
        lib.pagedkv_cpu_linear_bf16.restype = i32
        lib.pagedkv_cpu_linear_bf16_path.argtypes = []
        lib.pagedkv_cpu_linear_bf16_path.restype = ctypes.c_char_p
    if hasattr(lib, "pagedkv_cpu_llama_mlp"):  # (absent from libraries built before the fused Llama layer)
        lib.pagedkv_cpu_llama_attention_inputs.argtypes = [p, i64, i64, p, f32, p, i64, i64, i64, p, p, p, p, i32]
        lib.pagedkv_cpu_llama_attention_inputs.restype = i32
        lib.pagedkv_cpu_llama_mlp.argtypes = [p, i64, i64, p, i64, p, p, f32, p, i64, p, p, p, i32]
        lib.pagedkv_cpu_llama_mlp.restype = i32
    if hasattr(lib, "pagedkv_cpu_llama_mlp_bf16"):  # (absent from libraries built before the bf16 weights)
        lib.pagedkv_cpu_llama_attention_inputs_bf16.argtypes = lib.pagedkv_cpu_llama_attention_inputs.argtypes
        lib.pagedkv_cpu_llama_attention_inputs_bf16.restype = i32
        lib.pagedkv_cpu_llama_mlp_bf16.argtypes = lib.pagedkv_cpu_llama_mlp.argtypes
        lib.pagedkv_cpu_llama_mlp_bf16.restype = i32
    if hasattr(lib, "pagedkv_cpu_llama_attention_kv"):  # (absent from libraries built before the KV-writing call)
        layer_kv = [p, i64, i64, p, f32, p, i64, i64, i64, p, p, p, p, p, p, p, i64, i32]
        mlp_act = [p, i64, i64, p, i64, p, p, f32, p, i64, p, p, p, p, i32]
        for name, args in (("attention_kv", layer_kv), ("attention_kv_bf16", layer_kv),
                           ("attention_scratch", [i64, i64, i64]), ("mlp_bf16_act", mlp_act)):
            fn = getattr(lib, f"pagedkv_cpu_llama_{name}")
            fn.argtypes, fn.restype = args, (i64 if name == "attention_scratch" else i32)
    if hasattr(lib, "pagedkv_cpu_llama_scratch_rows"):  # (absent from libraries whose layer calls take all rows)
        lib.pagedkv_cpu_llama_scratch_rows.argtypes = []
        lib.pagedkv_cpu_llama_scratch_rows.restype = i32
    if hasattr(lib, "pagedkv_cpu_quant_linear"):  # (absent from libraries built before quantization gguf)
        lib.pagedkv_cpu_quant_linear.argtypes = [i32, p, i64, i64, p, i64, p, i32]
        lib.pagedkv_cpu_quant_linear.restype = i32
        lib.pagedkv_cpu_quant_llama_attention_inputs.argtypes = [p, i64, i64, p, f32, p, p, i64, i64, i64, p, p, p, p,
                                                                 i32]
        lib.pagedkv_cpu_quant_llama_attention_inputs.restype = i32
        lib.pagedkv_cpu_quant_llama_mlp.argtypes = [p, i64, i64, p, i64, p, f32, i64, p, p, p, p, i32]
        lib.pagedkv_cpu_quant_llama_mlp.restype = i32
    if hasattr(lib, "pagedkv_cpu_quant_int8_path"):  # (absent from libraries built before the integer path)
        lib.pagedkv_cpu_quant_int8_path.argtypes = []
        lib.pagedkv_cpu_quant_int8_path.restype = ctypes.c_char_p
        lib.pagedkv_cpu_quant_linear_int8.argtypes = lib.pagedkv_cpu_quant_linear.argtypes
        lib.pagedkv_cpu_quant_linear_int8.restype = i32
    return lib


_failed: dict[Path, str] = {}  # a build that failed is not retried by every new engine in this process


@cache
def load(isa: str | None = None) -> ctypes.CDLL:
    """The compiled kernel for ``isa`` (default: the best this CPU runs), built on first use in this cache;
    raises :class:`BuildError` (also for a build this CPU cannot execute)."""
    isa = isa or best_isa()
    if not runnable(isa):
        raise BuildError(f"this CPU cannot run the {isa} build of the CPU attention kernel")
    target = library_path(isa)
    if target in _failed:
        raise BuildError(_failed[target])
    try:
        lib = _load_or_build(target, isa)
    except BuildError as exc:
        _failed[target] = str(exc)
        raise
    lib.isa = isa
    return lib


def _load_or_build(target: Path, isa: str) -> ctypes.CDLL:
    if target.exists():
        try:
            return _bind(ctypes.CDLL(str(target)))
        except OSError as exc:  # e.g. built against another libstdc++: build again
            log.warning("pagedkv: cached CPU attention library %s does not load (%s); rebuilding", target, exc)
    seconds = compile_library(target, isa)
    log.info("pagedkv: built the %s CPU attention kernel in %.1f s -> %s", isa, seconds, target)
    try:
        return _bind(ctypes.CDLL(str(target)))
    except OSError as exc:
        raise BuildError(f"the freshly built {target} does not load: {exc}") from None
