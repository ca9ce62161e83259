"""Whether the cpu backend's bf16 path beats fp32 here, from the build the CPU runs (its features), for
``--dtype auto`` (:mod:`pagedkv.core.dtype_choice`).

The AVX-512 builds' packed kernels read bf16 weights (half of fp32's bytes) and either multiply them by
``vdpbf16ps`` (avx512-bf16) or widen them in registers (avx512): a batch-1 token of SmolLM2-135M took 13.2 ms
in bf16 against 19.3 ms in fp32 on an AVX-512-BF16 Zen machine (benchmarks/RESULTS.md). On the other builds
bf16 is not known to be faster, so auto keeps fp32 there, as vLLM's CPU backend does without AVX-512.
"""

from __future__ import annotations

from pagedkv.core.dtype_choice import DtypeFeatures

FAST_BF16_BUILDS = {
    "avx512-bf16": "the avx512-bf16 build multiplies bf16 weights by vdpbf16ps",
    "avx512": "the avx512 build widens bf16 weights in registers (half fp32's weight bytes)",
}


def cpu_dtype_features(isa: str | None, bf16_kernel: bool) -> DtypeFeatures:
    """The features of the ``isa`` build (None: a library bound by hand); ``bf16_kernel``: whether the backend
    runs bf16 weights through its own linear kernel (not forced to torch's route, not an older library)."""
    if isa not in FAST_BF16_BUILDS:
        return DtypeFeatures(False, f"the {isa or 'hand-bound'} build has no fast bf16 path (it needs AVX-512)")
    if not bf16_kernel:
        return DtypeFeatures(False, f"the {isa} build's bf16 linears are not running through the kernel")
    return DtypeFeatures(True, FAST_BF16_BUILDS[isa])


def features_for_cpu_flags(cpu_flags: str) -> DtypeFeatures:
    """The features of the build a CPU with ``cpu_flags`` (``/proc/cpuinfo`` flags) runs, with its kernel."""
    from pagedkv.backends.cpu import build

    return cpu_dtype_features(build.best_isa(cpu_flags), True)
