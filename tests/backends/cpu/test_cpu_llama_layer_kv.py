"""The fused layer's attention inputs written straight into the paged cache (``queries_into_cache``, one kernel call
instead of attention inputs + the backend's KV write) on every build this CPU runs, fp32 and bf16: q as
``attention_inputs`` gives it and within the float64 bound, the rotated k and the v in their slots bit for bit as the
backend's write puts them, every other slot untouched (the cache poisoned with NaN), and a cache it cannot write
declined with nothing written."""

from __future__ import annotations

import pytest
import torch
from test_cpu_llama_layer import (  # noqa: F401 - poisoned_scratch is an autouse fixture here too
    SHAPES,
    assert_within,
    attention_inputs64,
    make_layer,
    poisoned_scratch,
    rotary,
)
from test_cpu_llama_layer_bf16 import assert_bf16_within

from conftest import cpu_kernel_build
from pagedkv.backends.cpu import build
from pagedkv.backends.cpu.backend import CpuBackend
from pagedkv.backends.cpu.linear import CpuLinearKernel
from pagedkv.backends.cpu.llama_layers import CpuLlamaLayers

BLOCKS, BLOCK_SIZE = 6, 4


@pytest.fixture(params=build.checked_variants())
def lib(request):
    return cpu_kernel_build(request.param)


def setup(shape: str, rows: int, dtype: torch.dtype, seed: int):
    layer = make_layer(*SHAPES[shape], seed=seed).to(dtype)
    attn = layer.self_attn
    h = torch.randn(1, rows, attn.q_proj.in_features).to(dtype)
    cos, sin = (t.to(dtype) for t in rotary(rows, attn.head_dim, seed=seed))
    kv_heads = attn.k_proj.out_features // attn.head_dim
    caches = [torch.full((BLOCKS, BLOCK_SIZE, kv_heads, attn.head_dim), float("nan"), dtype=dtype) for _ in "kv"]
    # distinct slots in a shuffled order, and every third row skipped (a padded row's slot -1)
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=torch.Generator().manual_seed(seed))[:rows]
    slots[::3] = -1
    return layer, h, cos, sin, caches, slots


@pytest.mark.parametrize("rows", [1, 5, 13, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ["gqa_hd8", "mha_hd24", "gqa_hd64"])
def test_queries_into_cache_match_attention_inputs_and_the_kv_write(lib, shape, dtype, rows):
    layers = CpuLlamaLayers(lib, CpuLinearKernel(lib))
    layer, h, cos, sin, (k_cache, v_cache), slots = setup(shape, rows, dtype, seed=rows)
    assert layers.accepts(layer, h)
    q = layers.queries_into_cache(layer, h, cos, sin, k_cache, v_cache, slots)
    assert q is not None, "a contiguous cache of the activations' dtype is written by the kernel"
    q_ref, k_ref, v_ref = layers.attention_inputs(layer, h, cos, sin)
    assert torch.equal(q, q_ref), "q as attention_inputs gives it"
    expected_k, expected_v = (torch.full_like(c, float("nan")) for c in (k_cache, v_cache))
    CpuBackend(lib).write_kv(k_ref, v_ref, expected_k, expected_v, slots)
    for got, expected, name in ((k_cache, expected_k, "k"), (v_cache, expected_v, "v")):
        assert torch.equal(got.isnan(), expected.isnan()), f"{name}: slots written / left alone"
        assert torch.equal(got.nan_to_num(), expected.nan_to_num()), f"{name}: the rows the KV write puts there"
    (q64, q_tol), (k64, k_tol), _ = attention_inputs64(layer, h, cos, sin)
    written = slots >= 0
    k_rows = k_cache.view(-1, *k_cache.shape[2:])[slots[written]]
    for got, expected, tol, name in ((q, q64, q_tol, "q"), (k_rows, k64[written], k_tol[written], "k")):
        if dtype == torch.bfloat16:
            assert_bf16_within(got, expected, tol, 2 * h.shape[-1], f"{shape}, {rows} rows: {name}")
        else:
            assert_within(got, expected, tol, f"{shape}, {rows} rows: {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_queries_into_cache_decline_a_cache_they_cannot_write(lib, dtype):
    layers = CpuLlamaLayers(lib, CpuLinearKernel(lib))
    layer, h, cos, sin, (k_cache, v_cache), slots = setup("gqa_hd8", 5, dtype, seed=1)
    assert layers.accepts(layer, h)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    past_end = slots.clone()
    past_end[1] = BLOCKS * BLOCK_SIZE
    declined = {
        "another dtype": (k_cache.to(other), v_cache.to(other), slots),
        "a strided cache": (k_cache.transpose(0, 1), v_cache.transpose(0, 1), slots),
        "int32 slots": (k_cache, v_cache, slots.int()),
        "a slot past the end": (k_cache, v_cache, past_end),
    }
    for what, (k, v, s) in declined.items():
        before = (k.clone(), v.clone())
        assert layers.queries_into_cache(layer, h, cos, sin, k, v, s) is None, what
        assert torch.equal(k.isnan(), before[0].isnan()) and torch.equal(v.isnan(), before[1].isnan()), what
