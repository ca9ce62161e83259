"""Compile ``attention.cpp`` once per machine into the cache directory and load it with ctypes.

The kernel has a plain C interface, so it needs only a C++ compiler with OpenMP:
no Python headers, no pybind11, no ninja, and a build takes a few seconds
(``torch.utils.cpp_extension`` with ``torch/extension.h`` takes tens of seconds
here). It is built with ``-march=native``, so the cache key includes the CPU's
feature flags as well as the source and the flags: a cache shared between
machines never hands one CPU another's binary.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from functools import lru_cache
from pathlib import Path

log = logging.getLogger("pagedkv")

SOURCE = Path(__file__).resolve().parent / "attention.cpp"
HEADERS = ("decode.h", "prefill.h", "decode_int8.h")  # included by SOURCE: part of the cache key
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17")


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


def compiler() -> str | None:
    """The C++ compiler to use: ``$CXX`` or ``g++``/``c++`` on PATH (None: there is none)."""
    name = os.environ.get("CXX")
    if name:
        return shutil.which(name)
    return shutil.which("g++") or shutil.which("c++")


def library_path() -> Path:
    """Where the library for this source, these flags and this CPU lives."""
    from pagedkv.core.model.model_loader import cache_dir

    key = hashlib.sha256()
    sources = [SOURCE.read_bytes(), *((SOURCE.parent / name).read_bytes() for name in HEADERS)]
    for part in (*sources, " ".join(FLAGS).encode(), platform.machine().encode(), _cpu_flags().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / "cpu_attention" / f"pagedkv_cpu_attention_{key.hexdigest()[:16]}.so"


def _compile(target: Path) -> float:
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (set CXX or install g++)")
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", str(out)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"{cxx} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(out, target)  # atomic: a concurrent build never sees a half-written library
    return time.perf_counter() - started


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.pagedkv_cpu_attend.argtypes = [
        i32, p, i64, i64, p, p, p, p, i64, p, p, i32, i32, i32, i32, i32, f32, i32, f32, i32, i32,
    ]
    lib.pagedkv_cpu_attend.restype = i32
    lib.pagedkv_cpu_decode_int8.argtypes = [
        p, i64, i64, p, p, p, p, i64, p, i32, i32, i32, i32, i32, f32, i32, f32, i32,
    ]
    lib.pagedkv_cpu_decode_int8.restype = i32
    return lib


_failed: dict[Path, str] = {}  # a build that failed is not retried by every new engine in this process


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL:
    """The compiled kernel, built on first use in this cache; raises :class:`BuildError`."""
    target = library_path()
    if target in _failed:
        raise BuildError(_failed[target])
    try:
        return _load_or_build(target)
    except BuildError as exc:
        _failed[target] = str(exc)
        raise


def _load_or_build(target: Path) -> ctypes.CDLL:
    if target.exists():
        try:
            return _bind(ctypes.CDLL(str(target)))
        except OSError as exc:  # e.g. built against another libstdc++: build again
            log.warning("pagedkv: cached CPU attention library %s does not load (%s); rebuilding", target, exc)
    seconds = _compile(target)
    log.info("pagedkv: built the CPU attention kernel in %.1f s -> %s", seconds, target)
    try:
        return _bind(ctypes.CDLL(str(target)))
    except OSError as exc:
        raise BuildError(f"the freshly built {target} does not load: {exc}") from None
