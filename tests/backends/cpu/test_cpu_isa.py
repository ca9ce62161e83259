"""The cpu kernel's per-instruction-set builds and phase routes: which build a CPU gets, that every build
compiles on any x86 machine (even one that cannot run it), and where each phase runs.

The kernels themselves are checked against the float64 reference for every build this machine can execute
by test_cpu_backend.py and test_cpu_decode.py (their ``backend`` fixture is parametrized over the builds).
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.backends.cpu import build
from pagedkv.backends.cpu.routes import Routes

AVX512 = "fpu sse2 avx avx2 fma bmi1 bmi2 f16c movbe abm xsave avx512f avx512bw avx512cd avx512dq avx512vl"
AVX2 = "fpu sse2 avx avx2 fma bmi1 bmi2 f16c movbe abm xsave"
OLD = "fpu sse2 ssse3 sse4_1 sse4_2 avx"

x86_only = pytest.mark.skipif(not build.is_x86(), reason="the per-ISA builds are x86's; elsewhere one native build")


@x86_only
def test_best_build_by_cpu_flags(monkeypatch):
    monkeypatch.delenv("PAGEDKV_CPU_ISA", raising=False)
    assert build.best_isa(AVX512) == "avx512"
    assert build.best_isa(AVX2) == "avx2"
    assert build.best_isa(OLD) == "generic"
    assert build.best_isa(AVX512.replace(" avx512vl", "")) == "avx2"  # AVX-512 without VL is not x86-64-v4
    assert not build.runnable("avx2", OLD) and build.runnable("generic", OLD)


@x86_only
def test_forced_build_must_be_runnable(monkeypatch):
    monkeypatch.setenv("PAGEDKV_CPU_ISA", "generic")
    assert build.best_isa(AVX2) == "generic"
    monkeypatch.setenv("PAGEDKV_CPU_ISA", "avx512")
    with pytest.raises(build.BuildError, match="PAGEDKV_CPU_ISA='avx512'"):
        build.best_isa(AVX2)
    monkeypatch.setenv("PAGEDKV_CPU_ISA", "avx512-shape")  # a test build is never served
    with pytest.raises(build.BuildError, match="this CPU runs"):
        build.best_isa(AVX512)
    monkeypatch.setenv("PAGEDKV_CPU_ISA", "sse9")
    with pytest.raises(build.BuildError, match="this CPU runs"):
        build.best_isa(AVX2)


@x86_only
@pytest.mark.parametrize("isa", build.checked_variants())
def test_every_build_compiles(isa, tmp_path):
    # the AVX-512 build compiles on an AVX2 machine too (its kernel tests run only where the CPU has it;
    # elsewhere they run on the avx512-shape build: its widths and tiles in AVX2 instructions)
    if build.compiler() is None:
        pytest.skip("no C++ compiler here")
    if build.runnable(isa):
        lib = build.load(isa)  # (compiled once, shared with the kernel tests)
        assert lib.pagedkv_cpu_lanes() == build.LANES[isa] and lib.pagedkv_cpu_isa().decode() == isa
        return
    target = tmp_path / f"{isa}.so"
    build.compile_library(target, isa)
    assert target.stat().st_size > 0
    with pytest.raises(build.BuildError, match="cannot run"):
        build.load(isa)


def test_builds_are_cached_per_instruction_set():
    names = {build.library_path(isa).name for isa in build.checked_variants()}
    assert len(names) == len(build.checked_variants())


def test_linear_route_decides_the_backend_kernels():
    from pagedkv.backends.cpu import CpuBackend

    lib = build.load()
    assert CpuBackend(lib, routes=Routes()).linear_kernel is not None
    assert CpuBackend(lib, routes=Routes()).llama_layer_kernel is not None
    by_torch = CpuBackend(lib, routes=Routes(linear="torch"))
    assert by_torch.linear_kernel is None and by_torch.llama_layer_kernel is None


def test_prefill_by_torch_sends_no_prefill_to_the_kernel(monkeypatch):
    from attention_cases import make_case

    from pagedkv.backends.cpu import CpuBackend

    backend = CpuBackend(build.load(), routes=Routes(prefill="torch"))
    phases = []
    real = backend.lib.pagedkv_cpu_attend

    class Spy:
        def __call__(self, *args):
            phases.append(args[-1])
            return real(*args)

    backend.lib = type("Lib", (), {"pagedkv_cpu_attend": Spy()})()
    meta, q, k, v, *_ = make_case([40, 9], [30, 1], 16, 4, 2, 64, torch.float32, 0)
    backend.attend(q, k, v, meta, 0.125)
    meta, q, k, v, *_ = make_case([40, 9], [1, 1], 16, 4, 2, 64, torch.float32, 0)
    backend.attend(q, k, v, meta, 0.125)
    assert phases == [1, 3]  # decodes only while a prefill is in the step; everything in a decode-only step
