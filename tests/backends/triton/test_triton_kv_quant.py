"""The Triton backend on an 8-bit KV cache: its int8 write is bit-exact against the torch reference's, its
attention (mixed batch and split-KV decode) reads the dequantized cache as a float64 reference does, and a
whole engine run matches the torch backend's tokens. CPU: Triton's interpreter, so shapes are small; with
CUDA every tensor a kernel sees is on the GPU (the compiled kernels), and the float64 truths stay on the CPU."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from attention_cases import assert_nan_scale_read, make_case, nan_scale_case, reference  # noqa: E402

from conftest import random_prompts  # noqa: E402
from pagedkv import Engine, EngineConfig, SamplingParams  # noqa: E402
from pagedkv.backends.torch_ref.attention import write_kv as reference_write_kv  # noqa: E402
from pagedkv.backends.triton.copy_blocks import copy_blocks  # noqa: E402
from pagedkv.backends.triton.paged_attention import paged_attention  # noqa: E402
from pagedkv.backends.triton.split_kv_decode import split_kv_decode  # noqa: E402
from pagedkv.backends.triton.write_kv import write_kv  # noqa: E402
from pagedkv.core.kv.kv_dtype import QMAX, byte_view  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EIGHT_BIT = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("kv_dtype", EIGHT_BIT)
@pytest.mark.parametrize("block_size", [16, 1])
def test_write_kv_matches_the_reference_bit_for_bit(kv_dtype, block_size):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, heads, dim, tokens = 12, 3, 64, 9
    key = torch.randn(tokens, heads, dim, generator=gen) * torch.logspace(-4, 4, tokens)[:, None, None]
    value = torch.randn(tokens, heads, dim, generator=gen)
    key[2, 1] = 0.0  # an all-zero row: scale 0
    key[3, 0, :4] = torch.tensor([127.0, 2.5, -2.5, 0.5]) / 127 * key[3, 0].abs().max()  # near-ties
    key[5, 2] = torch.linspace(-127.0, 127.0, dim) * 1.625  # amax / 127 on the scale grid: that scale itself
    key[6, 0] = key[5, 2] * (1 + 2**-20)  # just above a grid point: the next code
    key[7, 1] *= 1e-36  # amax / 127 below the smallest scale: the smallest code, 1
    value[8, 1] *= 1e6  # above the largest scale (896): the largest code, clipped
    value[0, 2] = torch.linspace(-1.0, 1.0, dim) * (QMAX[kv_dtype] * 1.625)  # amax / QMAX on the grid, any dtype
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[4] = -1
    caches = [torch.full((num_blocks, block_size, heads, dim + 1), 5, dtype=torch.int8).view(kv_dtype)
              for _ in range(4)]
    caches[0], caches[1] = caches[0].to(DEVICE), caches[1].to(DEVICE)
    write_kv(key.to(DEVICE), value.to(DEVICE), caches[0], caches[1], slots.to(DEVICE))
    reference_write_kv(key, value, caches[2], caches[3], slots)  # the CPU reference defines the format
    assert torch.equal(byte_view(caches[0]).cpu(), byte_view(caches[2]))
    assert torch.equal(byte_view(caches[1]).cpu(), byte_view(caches[3]))
    assert not byte_view(caches[0]).eq(5).all()


@pytest.mark.parametrize("kv_dtype", EIGHT_BIT)
def test_copy_blocks_moves_values_and_scales(kv_dtype):
    caches = [tuple(torch.randint(-128, 127, (5, 4, 2, 17), dtype=torch.int8).view(kv_dtype).to(DEVICE)
                    for _ in range(2))
              for _ in range(2)]
    before = [(byte_view(k).clone(), byte_view(v).clone()) for k, v in caches]
    copy_blocks(caches, torch.tensor([[0, 3], [4, 1]]))
    for (k, v), (k0, v0) in zip(caches, before):
        for cache, old in ((k, k0), (v, v0)):
            assert torch.equal(byte_view(cache)[3], old[0]) and torch.equal(byte_view(cache)[1], old[4])
            assert torch.equal(byte_view(cache)[[0, 2, 4]], old[[0, 2, 4]])


def _check(kv_dtype, seq_lens, query_lens, block_size, split=0, **kw):
    meta, q, k_cache, v_cache, keys, values = make_case(seq_lens, query_lens, block_size, kv_dtype=kv_dtype,
                                                        device=DEVICE, **kw)
    scale = 1.0 / math.sqrt(q.shape[-1])
    if split:
        out = split_kv_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                              meta.max_seq_len, scale, split, tile_n=16)
    else:
        out = paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.context_lens,
                              meta.query_start_loc, meta.max_query_len, scale, tile_n=16)
    assert torch.isfinite(out).all(), "a NaN scale of an unused slot leaked into the output"
    q, out = q.cpu(), out.cpu()
    start = 0
    for n, q_len, k, v in zip(seq_lens, query_lens, keys, values):
        expected = reference(q[start : start + q_len], k, v, n - q_len, scale)
        torch.testing.assert_close(out[start : start + q_len].double(), expected, atol=2e-5, rtol=2e-5)
        start += q_len


@pytest.mark.parametrize("kv_dtype", EIGHT_BIT)
def test_mixed_batch_reads_the_dequantized_cache(kv_dtype):
    _check(kv_dtype, [1, 17, 40, 9], [1, 1, 20, 9], 16)
    _check(kv_dtype, [21], [4], 1, heads=6, kv_heads=3, dim=64)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e5m2])
def test_split_kv_decode_reads_the_dequantized_cache(kv_dtype):
    _check(kv_dtype, [70, 33, 5], [1, 1, 1], 16, split=3)


@pytest.mark.parametrize("kv_dtype", EIGHT_BIT)
def test_a_row_with_the_nan_scale_code_reads_as_nan(kv_dtype):
    meta, q, k_cache, v_cache = nan_scale_case(kv_dtype, device=DEVICE)
    assert_nan_scale_read(paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.context_lens,
                                          meta.query_start_loc, meta.max_query_len, 0.125, tile_n=16))
    assert_nan_scale_read(split_kv_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                          meta.query_start_loc, meta.max_seq_len, 0.125, 2, tile_n=16))


def test_engine_on_triton_matches_the_torch_backend_on_an_int8_cache(tiny_llama):
    prompts = random_prompts([7, 12], seed=41)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    model = copy.deepcopy(tiny_llama)  # the engine moves its model to DEVICE: the shared fixture stays on the CPU
    tokens = {}
    for backend in ("torch", "triton"):
        engine = Engine(EngineConfig(device=DEVICE, backend=backend, block_size=4, num_blocks=32,
                                     kv_cache_dtype="int8", enable_prefix_caching=True), model=model)
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step(stream=False)})
        tokens[backend] = [done[i] for i in ids]
        assert engine.pool.num_available == engine.num_blocks
    assert tokens["triton"] == tokens["torch"]
