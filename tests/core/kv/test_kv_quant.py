"""The 8-bit KV cache (``--kv-cache-dtype int8|fp8_e4m3|fp8_e5m2``): the row format, the torch reference's
quantizing write and dequantizing read against a float64 reference of the dequantized cache, and sizing."""

from __future__ import annotations

import math

import pytest
import torch
from attention_cases import assert_nan_scale_read, make_case, nan_scale_case, reference

from pagedkv.backends.cpu import build
from pagedkv.backends.cpu.backend import CpuBackend
from pagedkv.backends.torch_ref import TorchBackend
from pagedkv.backends.torch_ref.attention import copy_blocks, swap_blocks, write_kv
from pagedkv.core.config import EngineConfig
from pagedkv.core.errors import ConfigError
from pagedkv.core.kv.kv_cache import KVCacheSpec, allocate_kv_caches, capacity_line
from pagedkv.core.kv.kv_dtype import (
    QMAX,
    SCALE_NAN,
    byte_view,
    decode_scales,
    dequantize_rows,
    quantize_rows,
    scale_code,
    split_cache,
)

EIGHT_BIT = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
ROW_ERROR = {torch.int8: 0.5 * 1.125 / 127, torch.float8_e4m3fn: 1 / 16, torch.float8_e5m2: 1 / 8}  # of the row's amax


@pytest.mark.parametrize("kv_dtype", EIGHT_BIT)
def test_rows_round_trip_within_half_a_step_of_their_own_scale(kv_dtype):
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 3, 50)[:, None, None]
    x[7, 1] = 0.0
    packed = quantize_rows(x, kv_dtype)
    assert packed.shape == (50, 3, 65) and packed.dtype == kv_dtype
    values, codes = split_cache(packed, 64)
    assert codes.dtype == torch.uint8 and codes[7, 1] == 0 and values[7, 1].float().abs().max() == 0
    assert values.float().abs().max() <= QMAX[kv_dtype]
    err = (dequantize_rows(packed, 64) - x).abs().amax(-1) / x.abs().amax(-1).clamp_min(1e-30)
    assert err.max() <= ROW_ERROR[kv_dtype] * 1.01
    if kv_dtype == torch.int8:  # the scale is rounded up by less than 1/8: a row's peak lands in [113, 127]
        peaks = values.float().abs().amax(-1)[x.abs().amax(-1) > 0]
        assert peaks.min() >= 113 and peaks.max() <= 127
        assert ((dequantize_rows(packed, 64) - x).abs() <= decode_scales(codes)[..., None] / 2).all()  # half a step


def _grid(codes: torch.Tensor) -> torch.Tensor:
    """E5M3 codes 1..254 as float64 scales from the definition, 2^(e - 22) * (1 + m / 8), not from bits."""
    return torch.exp2((codes >> 3).double() - 22) * (1 + (codes & 7).double() / 8)


def test_every_scale_code_decodes_to_its_e5m3_value_and_encodes_back():
    codes = torch.arange(1, 255)
    scales = decode_scales(codes)
    assert torch.equal(scales.double(), _grid(codes))
    assert scales[0] == 1.125 * 2.0**-22 and scales[-1] == 1.75 * 2.0**9 and (scales.diff() > 0).all()
    assert decode_scales(torch.tensor([0])).item() == 0 and decode_scales(torch.tensor([SCALE_NAN])).isnan().all()
    assert torch.equal(scale_code(scales * 127, 127.0), codes)  # a grid point is its own code
    above = torch.nextafter(scales[:-1], torch.tensor(float("inf")))
    assert torch.equal(scale_code(above * 127, 127.0), codes[1:])  # one ulp above rounds up to the next
    below = torch.nextafter(scales[1:], torch.tensor(0.0))
    assert torch.equal(scale_code(below * 127, 127.0), codes[1:])  # one ulp below rounds up to the point


def test_the_scale_is_the_smallest_grid_point_at_or_above_amax_over_qmax_and_clamps_at_the_ends():
    amax = torch.tensor([0.0, 127.0, 127.0 * 1.875, 127.0 * 2.0**-22, 1e-42, 127.0 * 896, 1e30, float("inf"),
                         float("nan")])
    assert scale_code(amax, 127.0).tolist() == [0, 176, 183, 1, 1, 254, 254, SCALE_NAN, SCALE_NAN]
    amax = (torch.rand(10000) + 0.5) * 2.0 ** torch.randint(-10, 15, (10000,)).float()
    a = (amax / 448).double()
    scales = decode_scales(scale_code(amax, 448.0)).double()
    assert (scales >= a).all() and (scales < a * 1.125).all()  # rounded up, by less than one step
    assert 0.03 < (scales / a - 1).mean() < 0.06  # about 4% of the range unused on average


def test_scale_codes_above_127_survive_the_int8_byte_and_non_finite_rows_read_back_nan():
    x = torch.full((2, 8), 300.0)  # amax / 127 = 2.36 -> 2 * 1.25: code (1 + 22) * 8 + 2 = 186, the byte -70
    x[1, 3] = float("inf")
    packed = quantize_rows(x, torch.int8)
    assert split_cache(packed, 8)[1][0].item() == 186 and packed[0, 8].item() == 186 - 256
    assert torch.allclose(dequantize_rows(packed, 8)[0], x[0], rtol=0.5 / 113)
    assert dequantize_rows(packed, 8)[1].isnan().all()


def test_a_row_above_the_largest_scale_clips_at_it():
    x = torch.tensor([[1e6, -3.0, 0.5]])  # amax / 127 > 896
    packed = quantize_rows(x, torch.int8)
    assert split_cache(packed, 3)[1].item() == 254
    assert dequantize_rows(packed, 3).tolist() == [[127 * 896.0, 0.0, 0.0]]


def test_int8_rounds_half_to_even_against_the_stored_scale():
    x = torch.tensor([[[127.0, 2.5, -2.5, 3.5, 0.49, -0.5]]])  # scale 1.0 exactly
    values, codes = split_cache(quantize_rows(x, torch.int8), 6)
    assert decode_scales(codes).item() == 1.0 and values.flatten().tolist() == [127, 2, -2, 4, 0, 0]


@pytest.mark.parametrize("kv_dtype", EIGHT_BIT)
@pytest.mark.parametrize("block_size", [1, 16])
def test_write_kv_quantizes_each_row_into_its_slot_and_skips_minus_one(kv_dtype, block_size):
    spec = KVCacheSpec(1, 2, 8, block_size, kv_dtype)
    [(k_cache, v_cache)] = allocate_kv_caches(spec, 4, "cpu")
    assert k_cache.shape == (4, block_size, 2, 9) and k_cache.dtype == kv_dtype
    byte_view(k_cache).fill_(85)  # the cache is allocated uninitialised: mark every slot to see which are written
    byte_view(v_cache).fill_(85)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([3, -1, 2])
    write_kv(key, value, k_cache, v_cache, slots)
    flat_k, flat_v = byte_view(k_cache).view(-1, 2, 9), byte_view(v_cache).view(-1, 2, 9)
    assert torch.equal(flat_k[3], byte_view(quantize_rows(key[0], kv_dtype)))
    assert torch.equal(flat_v[2], byte_view(quantize_rows(value[2], kv_dtype)))
    untouched = [s for s in range(4 * block_size) if s not in (2, 3)]
    assert flat_k[untouched].eq(85).all() and flat_v[untouched].eq(85).all()


def _check(backend, seq_lens, query_lens, block_size, kv_dtype, tol=2e-5, window=None, softcap=None, **kw):
    meta, q, k_cache, v_cache, keys, values = make_case(seq_lens, query_lens, block_size, kv_dtype=kv_dtype, **kw)
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = backend.attend(q, k_cache, v_cache, meta, scale, window=window, softcap=softcap)
    assert out.dtype == q.dtype and torch.isfinite(out).all(), "a NaN scale of an unused slot leaked into the output"
    start = 0
    for n, q_len, k, v in zip(seq_lens, query_lens, keys, values):
        expected = reference(q[start : start + q_len], k, v, n - q_len, scale, window, softcap)
        torch.testing.assert_close(out[start : start + q_len].double(), expected, atol=tol, rtol=tol)
        start += q_len


@pytest.mark.parametrize("backend", [TorchBackend("cpu"), CpuBackend()], ids=["torch", "cpu"])
@pytest.mark.parametrize("kv_dtype", EIGHT_BIT)
@pytest.mark.parametrize("block_size", [1, 16])
def test_attention_reads_the_dequantized_cache(backend, kv_dtype, block_size):
    # decodes at block edges, a prefill chunk over cached context, a fresh prefill, GQA
    _check(backend, [1, 17, 40, 9], [1, 1, 20, 9], block_size, kv_dtype)
    _check(backend, [33, 16], [1, 16], block_size, kv_dtype, heads=6, kv_heads=3, dim=64)


@pytest.mark.parametrize(("backend", "kv_dtype"), [(TorchBackend("cpu"), d) for d in EIGHT_BIT]
                         + [(CpuBackend(), torch.int8)], ids=["torch-int8", "torch-e4m3", "torch-e5m2", "cpu-int8"])
def test_a_row_with_the_nan_scale_code_reads_as_nan(backend, kv_dtype):
    meta, q, k_cache, v_cache = nan_scale_case(kv_dtype)
    assert_nan_scale_read(backend.attend(q, k_cache, v_cache, meta, 0.125))


@pytest.fixture(scope="module", params=build.checked_variants())
def int8_kernel(request):
    """The cpu backend on each build of the kernel this CPU executes (avx512 / avx2 / generic: each has its
    own int8 row widening in simd.h)."""
    if not build.runnable(request.param):
        pytest.skip(f"this CPU cannot execute the {request.param} build")
    return CpuBackend(build.load(request.param))


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dim", [64, 128, 40])
def test_cpu_int8_decode_kernel_reads_the_dequantized_cache(int8_kernel, block_size, dim):
    # decode-only steps take the compiled int8 kernel (vector head dims 64/128, scalar 40), GQA 3:1
    _check(int8_kernel, [1, 17, 300, 16, 33], [1] * 5, block_size, torch.int8, heads=6, kv_heads=2, dim=dim)


@pytest.mark.parametrize(("window", "softcap"), [(7, None), (None, 5.0), (40, 2.0)])
def test_cpu_int8_decode_kernel_window_and_softcap(int8_kernel, window, softcap):
    _check(int8_kernel, [5, 50, 129], [1, 1, 1], 16, torch.int8, window=window, softcap=softcap, dim=64)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("heads", "kv_heads"), [(3, 3), (9, 3), (16, 2)])  # groups 1, 3 and 8 (two passes of 4)
@pytest.mark.parametrize("dim", [32, 64, 128, 256])
def test_cpu_int8_decode_kernel_groups_and_ragged_lengths(int8_kernel, threads, heads, kv_heads, dim):
    # lengths off the block (16), the step (4/8/16 keys) and the prefetch distance (32); one sequence
    # (its KV heads split into units) and nine (a unit a sequence)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for lens in ([131], [1, 5, 8, 9, 23, 33, 47, 70, 100]):
            _check(int8_kernel, lens, [1] * len(lens), 16, torch.int8, heads=heads, kv_heads=kv_heads, dim=dim)
    finally:
        torch.set_num_threads(previous)


def test_cpu_int8_decode_kernel_is_really_used(monkeypatch):
    backend = CpuBackend()
    meta, q, k_cache, v_cache, *_ = make_case([20], [1], 16, dim=64, kv_dtype=torch.int8)
    monkeypatch.setattr(TorchBackend, "attend", lambda *a, **k: pytest.fail("fell back to the reference"))
    assert torch.isfinite(backend.attend(q, k_cache, v_cache, meta, 0.125)).all()


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_cast_caches_of_a_float32_model(kv_dtype):
    _check(CpuBackend(), [17, 40], [1, 7], 16, kv_dtype, tol=2e-5)


@pytest.mark.parametrize("kv_dtype", EIGHT_BIT)
def test_block_copies_and_swaps_carry_the_scales(kv_dtype):
    spec = KVCacheSpec(2, 2, 8, 4, kv_dtype)
    device, host = allocate_kv_caches(spec, 6, "cpu"), allocate_kv_caches(spec, 3, "cpu")
    for k, v in device:
        write_kv(torch.randn(24, 2, 8), torch.randn(24, 2, 8), k, v, torch.arange(24))
    before = [(byte_view(k).clone(), byte_view(v).clone()) for k, v in device]
    copy_blocks(device, torch.tensor([[1, 5]]))
    swap_blocks(device, host, torch.tensor([[2, 0], [3, 2]]))
    for (k, v), (hk, hv), (k0, v0) in zip(device, host, before):
        for cache, old, swapped in ((k, k0, hk), (v, v0, hv)):
            assert torch.equal(byte_view(cache)[5], old[1])
            assert torch.equal(byte_view(swapped)[0], old[2]) and torch.equal(byte_view(swapped)[2], old[3])
            assert torch.equal(split_cache(swapped, 8)[1][0], split_cache(old.view(kv_dtype), 8)[1][2])


def test_bytes_per_block_count_the_scales():
    fp32 = KVCacheSpec(30, 3, 64, 16, torch.float32)
    int8 = KVCacheSpec(30, 3, 64, 16, torch.int8)
    bf16 = KVCacheSpec(30, 3, 64, 16, torch.bfloat16)
    assert int8.bytes_per_block == 2 * 30 * 16 * 3 * 65
    assert fp32.bytes_per_block / int8.bytes_per_block == pytest.approx(4 * 64 / 65)  # 3.94x
    assert bf16.bytes_per_block / int8.bytes_per_block == pytest.approx(2 * 64 / 65)
    line = capacity_line(int8.blocks_for_bytes(2**30), int8, 2048, kv_cache_dtype="int8")
    assert "of int8" in line and line.startswith("KV cache: 5735 blocks of 16 tokens = 91760 tokens")
    assert int8.blocks_for_bytes(2**30) >= 3.9 * fp32.blocks_for_bytes(2**30)  # issue 29's capacity goal


def test_config_reads_the_flag_and_auto_is_the_model_dtype():
    assert EngineConfig(device="cpu", dtype="float32").kv_dtype == torch.float32
    assert EngineConfig(device="cpu", dtype="bfloat16").kv_dtype == torch.bfloat16
    assert EngineConfig(device="cpu", kv_cache_dtype="INT8").kv_dtype == torch.int8
    assert EngineConfig(device="cpu", kv_cache_dtype="fp8_e5m2").kv_dtype == torch.float8_e5m2
    with pytest.raises(ConfigError, match="unknown kv_cache_dtype 'int4'; use one of auto, bfloat16"):
        EngineConfig(device="cpu", kv_cache_dtype="int4")


def test_cli_flag_sizes_simulate_and_a_bad_value_is_one_error_line(capsys):
    import json

    from pagedkv.cli.main import main

    blocks = {}
    for kv_dtype in ("auto", "int8"):
        assert main(["simulate", "--workload", "alpaca", "--num-requests", "20", "--dtype", "float32",
                     "--kv-cache-dtype", kv_dtype, "--kv-cache-memory", "64MiB", "--no-static", "--json"]) == 0
        blocks[kv_dtype] = json.loads(capsys.readouterr().out)["paged"]["num_blocks"]
    assert blocks["int8"] / blocks["auto"] == pytest.approx(4 * 64 / 65, rel=0.01)
    assert main(["run", "--kv-cache-dtype", "int4", "--prompt", "hi"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == ["engine: error: unknown kv_cache_dtype 'int4'; use one of auto, bfloat16, float16, int8, "
                   "fp8_e4m3, fp8_e5m2"]
