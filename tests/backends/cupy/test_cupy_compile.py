"""CPU checks of the CuPy backend's CUDA sources: every instantiation compiles to PTX through NVRTC, no GPU needed."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pagedkv.backends.cupy import compile as kc

ARCHS = (80, 90)


def _nvrtc():
    """cupy.cuda.nvrtc with a loadable libnvrtc, or skip with the reason."""
    cupy = pytest.importorskip("cupy", reason="cupy is not installed (pip install cupy-cuda13x)")
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # noqa: BLE001 - any failure to load libnvrtc means "cannot check here"
        pytest.skip(f"NVRTC is not loadable with cupy {cupy.__version__} ({exc}); pip install nvidia-cuda-nvrtc")
    return nvrtc


@pytest.fixture(scope="module")
def compiled() -> dict[int, tuple[str, dict[str, str]]]:
    """PTX and lowered names of every instantiation, per arch; the archs compile in parallel threads."""
    nvrtc = _nvrtc()
    supported = set(nvrtc.getSupportedArchs())
    missing = [a for a in ARCHS if a not in supported]
    if missing:
        pytest.fail(f"this NVRTC ({nvrtc.getVersion()}) cannot target sm_{missing}; supports {sorted(supported)}")
    # Load libnvrtc-builtins once before going parallel: concurrent first loads can fail to open it.
    kc.compile_ptx(ARCHS[0], [kc.names_for(torch.float32, 64, 16).write_kv])
    start = time.perf_counter()
    with ThreadPoolExecutor(len(ARCHS)) as pool:
        futures = {arch: pool.submit(kc.compile_ptx, arch) for arch in ARCHS}
        results = {}
        for arch, future in futures.items():
            try:
                results[arch] = future.result()
            except kc.CompileError as exc:
                pytest.fail(f"CUDA sources do not compile for sm_{arch}:\n{exc}", pytrace=False)
    print(f"compiled {len(kc.all_instantiations())} instantiations for {ARCHS} in {time.perf_counter() - start:.1f}s")
    return results


@pytest.mark.parametrize("arch", ARCHS)
def test_every_instantiation_compiles_to_ptx(compiled, arch: int) -> None:
    ptx, lowered = compiled[arch]
    assert f".target sm_{arch}" in ptx
    names = kc.all_instantiations()
    assert set(lowered) == set(names)
    for name in names:
        mangled = lowered[name]
        assert f".entry {mangled}(" in ptx, f"{name} ({mangled}) has no entry point in the PTX"


def test_instantiations_cover_the_backend() -> None:
    """Every (dtype, head_dim, block_size) the backend accepts maps onto a listed instantiation."""
    listed = set(kc.all_instantiations())
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for head_dim in kc.HEAD_DIMS:
            for block_size in (1, 7, 8, 16, 32, 64, 256):
                for cache_dtype in (None, dtype, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2):
                    names = kc.names_for(dtype, head_dim, block_size, cache_dtype)
                    assert set(names.all()) <= listed
                    for group_size in (1, 2, 3, 4, 7, 8, 9, 16, 32):
                        assert names.decode[kc.head_tile(group_size)] in listed


def test_8bit_caches_have_their_own_attention_kernels() -> None:
    plain = kc.names_for(torch.float16, 64, 16)
    assert kc.names_for(torch.float16, 64, 16, torch.float16) == plain
    seen = {tuple(plain.attention())}
    for cache_dtype, tag in kc.KV_TAGS.items():
        names = kc.names_for(torch.float16, 64, 16, cache_dtype)
        assert names.prefill == f"pagedkv_prefill<pagedkv::F16, 64, 16, {tag}>"
        assert names.decode[4] == f"pagedkv_decode<pagedkv::F16, 64, 16, 4, {tag}>"
        assert names.reduce == plain.reduce and names.cache_ops() == plain.cache_ops()
        seen.add(tuple(names.attention()))
    assert len(seen) == 1 + len(kc.KV_TAGS)


def test_compile_error_reports_the_log() -> None:
    _nvrtc()
    with pytest.raises(kc.CompileError) as info:
        kc.compile_ptx(ARCHS[0], ["pagedkv_decode<pagedkv::F16, 12, 16, 1>"])  # 12 halves is not 16-byte rows
    assert "16 bytes" in info.value.log


def test_source_inlines_the_common_header_once() -> None:
    text = kc.source()
    assert '#include "' not in text
    assert text.count("struct F32 {") == 1
    for name in kc.SOURCE_FILES:
        assert (kc.SOURCE_DIR / name).is_file()


def test_helpers() -> None:
    assert kc.block_size_param(16) == 16
    assert kc.block_size_param(7) == 0
    assert [kc.head_tile(g) for g in (1, 2, 3, 4, 5, 8, 9, 32)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert kc.copy_word(16 * 4 * 64 * 2, 256) == "uint4"
    assert kc.copy_word(6, 256) == "unsigned short"
    assert kc.copy_word(12, 4) == "unsigned int"
    assert kc.copy_word(3, 256) == "unsigned char"
