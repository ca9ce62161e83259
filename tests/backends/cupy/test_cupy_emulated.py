"""The CUDA kernels' logic, checked on the CPU: a host emulation runs them, one OS thread per CUDA thread.

No GPU is needed: the .cu sources are compiled as C++20 with a small shim
(threadIdx/blockIdx, __syncthreads as a std::barrier, warp shuffles through a
per-warp buffer and barrier, fp16 conversions through _Float16), and
``CupyBackend`` runs against a stand-in ``cupy`` whose kernels call into that
library. The checks are the ones in ``test_cupy_gpu.py``, on CPU tensors, so
the backend's launch code (grids, shared memory sizes, argument order) is
exercised too. It all runs in a subprocess, because the stand-in has to make
torch claim a CUDA device. This cannot see GPU-only faults (alignment traps,
races the OS scheduler does not expose, register limits): ``test_cupy_gpu.py``
on a GPU remains the real check. Skipped without g++ (C++20, <barrier>).
Each emulated CUDA thread flushes subnormals (x86 MXCSR FTZ and DAZ, Arm FPCR FZ), as
the GPU does: CuPy always compiles the kernels with ``-ftz=true``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from repo_paths import TESTS

from pagedkv.backends.cupy import compile as kc

TESTS_DIR = TESTS
SHIM = r"""// Host emulation of the CUDA features the pagedkv kernels use: one OS thread per CUDA thread.
#include <math.h>
#include <cstring>
#include <cstdint>
#include <cstdio>
#include <barrier>
#include <thread>
#include <vector>
#include <functional>
#include <map>
#include <string>
#include <algorithm>
#include <utility>
#include <type_traits>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif
// CuPy compiles every kernel with -ftz=true: float instructions read subnormal operands as (signed) zero
// and flush subnormal results. Each emulated thread does the same, so a kernel that relies on subnormals
// fails here as it does on the GPU.
static inline void emu_flush_subnormals() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(_mm_getcsr() | 0x8040u);  // FTZ (bit 15) and DAZ (bit 6)
#elif defined(__aarch64__)
    unsigned long fpcr;
    asm volatile("mrs %0, fpcr" : "=r"(fpcr));
    asm volatile("msr fpcr, %0" : : "r"(fpcr | (1ul << 24)));  // FZ
#endif
}
struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct uint4 { unsigned x, y, z, w; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __restrict__
#define __shared__ static
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
static inline float emu_h2f(unsigned short b) { _Float16 h; memcpy(&h, &b, 2); return (float)h; }
static inline unsigned short emu_f2h(float f) {
    _Float16 h = (_Float16)f;
    unsigned short b;
    memcpy(&b, &h, 2);
    return b;
}
using std::min; using std::max;
static std::barrier<>* g_block_barrier;
static std::barrier<>* g_warp_barriers[32];
static float g_shfl_buf[1024];
static std::vector<float> g_dyn;
static float* emu_dyn_smem() { return g_dyn.data(); }
static inline void __syncthreads() { g_block_barrier->arrive_and_wait(); }
static inline float __shfl_xor_sync(unsigned, float v, int lane_mask, int width = 32) {
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    float* buf = g_shfl_buf + warp * 32;
    buf[lane] = v;
    g_warp_barriers[warp]->arrive_and_wait();
    int src = (lane & ~(width - 1)) | ((lane ^ lane_mask) & (width - 1));
    float r = buf[src];
    g_warp_barriers[warp]->arrive_and_wait();
    return r;
}
"""
TAIL = r"""template <typename... Args, size_t... I>
static void call_with(void (*k)(Args...), void** p, std::index_sequence<I...>) {
    k(*reinterpret_cast<std::remove_cv_t<std::remove_reference_t<Args>>*>(p[I])...);
}
template <typename... Args>
static void launch(void (*k)(Args...), dim3 grid, dim3 block, size_t smem, void** p) {
    blockDim = block; gridDim = grid;
    const unsigned nt = block.x;
    for (unsigned z = 0; z < grid.z; ++z) for (unsigned y = 0; y < grid.y; ++y) for (unsigned x = 0; x < grid.x; ++x) {
        g_dyn.assign(smem / 4 + 1, NAN);
        std::barrier<> bb(nt);
        g_block_barrier = &bb;
        std::vector<std::barrier<>*> wb;
        for (unsigned w = 0; w < (nt + 31) / 32; ++w) {
            wb.push_back(new std::barrier<>(std::min(32u, nt - 32 * w)));
            g_warp_barriers[w] = wb.back();
        }
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < nt; ++t)
            ts.emplace_back([=] {
                emu_flush_subnormals();
                threadIdx = dim3{t, 0, 0};
                blockIdx = dim3{x, y, z};
                call_with(k, p, std::index_sequence_for<Args...>{});
            });
        for (auto& t : ts) t.join();
        for (auto* b : wb) delete b;
    }
}
typedef std::function<void(dim3, dim3, size_t, void**)> Launcher;
extern std::map<std::string, Launcher>& registry();
extern "C" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, size_t smem,
                          void** params) {
    auto it = registry().find(name);
    if (it == registry().end()) { fprintf(stderr, "no kernel %s\n", name); return 1; }
    it->second(dim3{gx, gy, gz}, dim3{bx, 1, 1}, smem, params);
    return 0;
}
"""
# NVRTC-only pieces of the sources and their host replacements.
HOST_REPLACEMENTS = {
    'asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));': "f = emu_h2f(bits);",
    'asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(f));': "bits = emu_f2h(f);",
    "extern __shared__ float smem[];": "float* smem = emu_dyn_smem();",
}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (16, 64)
EIGHT_BIT_HEAD_DIMS = (64, 128)

# (check function in test_cupy_gpu.py, dtype name, keyword arguments)
CASES = [
    *[("check_decode_lengths", dt, {"long": 150}) for dt in ("float32", "float16", "bfloat16")],
    *[("check_prefill", dt, {}) for dt in ("float32", "float16", "bfloat16")],
    ("check_mixed", "float16", {"long": 150}),
    ("check_mixed", "float32", {"long": 100, "block_size": 7}),
    ("check_decode_lengths", "bfloat16", {"long": 60, "heads": (9, 3), "head_dim": 16}),
    ("check_decode_lengths", "float16", {"long": 60, "heads": (32, 2)}),
    ("check_decode_lengths", "float32", {"long": 60, "heads": (4, 4)}),
    ("check_prefill", "bfloat16", {"heads": (9, 3), "head_dim": 16}),
    ("check_matches_torch_reference", "float32", {}),
    ("check_noncontiguous_query", "bfloat16", {}),
    ("check_write_then_attend", "float16", {}),
    *[("check_write_kv", dt, {}) for dt in ("float32", "float16", "bfloat16")],
    ("check_write_kv", "float16", {"block_size": 3, "num_kv_heads": 1, "head_dim": 6}),
    *[("check_write_kv_8bit", dt, {}) for dt in ("float32", "bfloat16")],
    ("check_write_kv_8bit", "float16", {"block_size": 3, "num_kv_heads": 1, "head_dim": 6}),
    ("check_write_kv_8bit", "float16", {"kv_dtype": "float8_e4m3fn"}),
    ("check_write_kv_8bit", "float32", {"kv_dtype": "float8_e5m2", "block_size": 3, "num_kv_heads": 1,
                                        "head_dim": 6}),
    ("check_write_kv_8bit", "bfloat16", {"kv_dtype": "float8_e5m2"}),
    *[("check_fp8_write_rounding", "float32", {"kv_dtype": kv}) for kv in ("float8_e4m3fn", "float8_e5m2")],
    *[("check_8bit_scale_edges", dt, {"kv_dtype": kv}) for dt in ("float32", "bfloat16")
      for kv in ("int8", "float8_e4m3fn", "float8_e5m2")],
    # 8-bit caches read in the kernels: mixed decode / prefill, GQA 3 and 1, head dims 64 / 128, block sizes 16 / 7
    ("check_8bit_attention", "float16", {"seq_lens": [1, 17, 150, 33, 40], "query_lens": [1, 1, 1, 33, 7],
                                         "heads": [6, 2]}),
    ("check_8bit_attention", "bfloat16", {"seq_lens": [3, 130, 21], "query_lens": [1, 1, 9], "heads": [4, 4],
                                          "head_dim": 128, "block_size": 7}),
    ("check_8bit_attention", "float32", {"seq_lens": [9, 70, 26], "query_lens": [1, 1, 17], "heads": [3, 1],
                                         "window": 20, "softcap": 2.5, "partition": 16}),
    ("check_8bit_attention", "float16", {"seq_lens": [1, 40, 150, 30], "query_lens": [1, 1, 1, 11],
                                         "heads": [6, 2], "kv_dtype": "float8_e4m3fn"}),
    ("check_8bit_attention", "bfloat16", {"seq_lens": [3, 130, 21], "query_lens": [1, 1, 9], "heads": [4, 4],
                                          "head_dim": 128, "block_size": 7, "kv_dtype": "float8_e5m2"}),
    *[("check_8bit_nan_scale", dt, {"kv_dtype": kv}) for dt, kv in (("float32", "int8"), ("bfloat16", "float8_e5m2"))],
    ("check_copy_blocks", "float32", {}),
    ("check_copy_blocks", "float16", {"block_size": 1, "num_kv_heads": 1, "head_dim": 3}),
    ("check_copy_blocks", "bfloat16", {"block_size": 3, "num_kv_heads": 1, "head_dim": 6}),
    ("partition_16", "float16", {}),
    ("check_window_softcap", "float32", {"window": 7, "partition": 16}),
    ("check_window_softcap", "float16", {"softcap": 2.0}),
    ("check_window_softcap", "bfloat16", {"window": 30, "softcap": 3.0, "partition": 16}),
    ("check_window_softcap", "float32", {"window": 1}),
]

RUNNER = textwrap.dedent(
    """
    import contextlib, ctypes, importlib.util, json, sys, traceback, types
    import numpy as np
    import torch

    lib_path, tests_dir, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    sys.path.insert(0, tests_dir)  # the checks import attention_cases
    lib = ctypes.CDLL(lib_path)
    lib.emu_launch.argtypes = [ctypes.c_char_p] + [ctypes.c_uint] * 4 + [ctypes.c_size_t, ctypes.c_void_p]
    lib.emu_launch.restype = ctypes.c_int


    class FakeArray:
        def __init__(self, t):
            assert t.device.type == "cpu"
            self.t, self.ptr = t, t.data_ptr()


    class Kernel:
        def __init__(self, name):
            self.name = name

        def __call__(self, grid, block, args, shared_mem=0):
            values = []
            for a in args:
                if isinstance(a, FakeArray):
                    values.append(ctypes.c_uint64(a.ptr))
                elif isinstance(a, np.int32):
                    values.append(ctypes.c_int32(int(a)))
                elif isinstance(a, np.int64):
                    values.append(ctypes.c_int64(int(a)))
                elif isinstance(a, np.float32):
                    values.append(ctypes.c_float(float(a)))
                else:
                    raise TypeError(f"{self.name}: argument of type {type(a)} (scalars must be numpy-wrapped)")
            params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
            assert block[1] == block[2] == 1 and shared_mem <= 48 * 1024, (block, shared_mem)
            if lib.emu_launch(self.name.encode(), grid[0], grid[1], grid[2], block[0], shared_mem, params):
                raise RuntimeError(f"{self.name} is not in the emulation library")


    class RawModule:
        def __init__(self, code=None, options=(), name_expressions=()):
            self.names = list(name_expressions)

        def compile(self):
            pass

        def get_function(self, name):
            assert name in self.names, name
            return Kernel(name)


    cupy = types.ModuleType("cupy")
    cupy.RawModule, cupy.from_dlpack = RawModule, FakeArray
    cupy.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1),
        Device=lambda i: contextlib.nullcontext(),
        get_current_stream=lambda: types.SimpleNamespace(synchronize=lambda: None),
    )
    sys.modules["cupy"] = cupy
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_properties = lambda d: types.SimpleNamespace(multi_processor_count=132)

    from pagedkv.backends.cupy.backend import CupyBackend

    spec = importlib.util.spec_from_file_location("cupy_gpu_checks", tests_dir + "/backends/cupy/test_cupy_gpu.py")
    checks = importlib.util.module_from_spec(spec)
    sys.modules["cupy_gpu_checks"] = checks
    spec.loader.exec_module(checks)

    backend = CupyBackend(types.SimpleNamespace(device="cuda", dtype=torch.float16, block_size=16))
    backend.device = torch.device("cpu")
    backend._stream = contextlib.nullcontext
    failed = 0
    for name, dtype, kwargs in cases:
        dtype = getattr(torch, dtype)
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}
        try:
            if name == "partition_16":
                backend.partition_size = 16
                checks.check_decode_lengths(backend, "cpu", dtype, long=100)
                checks.check_mixed(backend, "cpu", dtype, long=100)
                backend.partition_size = None
            else:
                getattr(checks, name)(backend, "cpu", dtype, **kwargs)
            print("ok  ", name, dtype, kwargs, flush=True)
        except Exception:
            failed += 1
            print("FAIL", name, dtype, kwargs, flush=True)
            traceback.print_exc()
    sys.exit(1 if failed else 0)
    """
)


def _instantiations() -> list[str]:
    names: dict[str, None] = {}
    for dtype in DTYPES:
        for block_size in (16, 0):
            for head_dim in HEAD_DIMS:
                names.update(dict.fromkeys(kc.names_for(dtype, head_dim, block_size).all()))
            for head_dim in EIGHT_BIT_HEAD_DIMS:
                for kv_dtype in kc.KV_TAGS:
                    names.update(dict.fromkeys(kc.names_for(dtype, head_dim, block_size, kv_dtype).attention()))
    return list(names)


@pytest.fixture(scope="module")
def emulation_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("g++ is not installed (needed to build the host emulation of the kernels)")
    source = kc.source()
    for cuda, host in HOST_REPLACEMENTS.items():
        assert cuda in source, f"the emulation no longer matches the sources: {cuda!r} is gone"
        source = source.replace(cuda, host)
    registry = "".join(
        f'        {{"{n}", [](dim3 g, dim3 b, size_t s, void** p) {{ launch(&{n}, g, b, s, p); }}}},\n'
        for n in _instantiations()
    )
    registry = (
        "std::map<std::string, Launcher>& registry() {\n    static std::map<std::string, Launcher> r = {\n"
        + registry
        + "    };\n    return r;\n}\n"
    )
    code = SHIM + source + TAIL + registry
    work = tmp_path_factory.mktemp("cupy_emulation")
    (work / "emu.cpp").write_text(code)
    lib = work / "libpagedkv_emu.so"
    cmd = [cxx, "-std=c++20", "-O1", "-w", "-fPIC", "-shared", "-pthread", str(work / "emu.cpp"), "-o", str(lib)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        if "barrier" in result.stderr and "No such file" in result.stderr:
            pytest.skip("this g++ has no C++20 <barrier>")
        pytest.fail(f"the host emulation does not build:\n{result.stderr[-6000:]}", pytrace=False)
    return lib


def test_kernels_match_the_reference_in_host_emulation(emulation_library: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, str(emulation_library), str(TESTS_DIR), json.dumps(CASES)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, f"emulated kernel checks failed:\n{result.stdout}\n{result.stderr[-8000:]}"
    assert result.stdout.count("ok  ") == len(CASES)
