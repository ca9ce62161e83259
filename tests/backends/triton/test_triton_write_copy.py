"""Triton ``write_kv`` and ``copy_blocks``: bit-exact, and nothing outside their target slots changes."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from pagedkv.backends.triton.copy_blocks import copy_blocks  # noqa: E402
from pagedkv.backends.triton.write_kv import write_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits, so NaN == NaN and -0.0 != 0.0: equality means bit-exact."""
    return t.cpu().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def random_cache(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    cache = torch.randn(shape, generator=gen).to(dtype)
    cache.view(-1)[:: 7] = float("nan")  # some NaN sentinels must survive untouched too
    return cache.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 5, 1])
def test_write_kv_is_bit_exact_and_skips_padding_slots(dtype: torch.dtype, block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, heads, dim, tokens = 12, 3, 64, 11
    k_cache = random_cache((num_blocks, block_size, heads, dim), dtype, gen)
    v_cache = random_cache((num_blocks, block_size, heads, dim), dtype, gen)
    key = torch.randn(tokens, heads, dim, generator=gen).to(dtype).to(DEVICE)
    value = torch.randn(tokens, heads, dim, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[0, 4, 10]] = -1  # padding tokens
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = key[t]
            expected_v[slot // block_size, slot % block_size] = value[t]
    assert not torch.equal(bits(expected_k), bits(k_cache))

    write_kv(key, value, k_cache, v_cache, slots.to(DEVICE))

    assert torch.equal(bits(k_cache), bits(expected_k))
    assert torch.equal(bits(v_cache), bits(expected_v))


def test_write_kv_reads_strided_views_of_fused_qkv() -> None:
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, block_size, tokens = 4, 2, 64, 8, 6
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen).to(DEVICE)
    key, value = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    assert not key.is_contiguous()
    k_cache = torch.full((3, block_size, kv_heads, dim), float("nan"), device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = torch.tensor([9, 10, 11, 12, 13, 14], device=DEVICE)  # block 1 offsets 1..6

    write_kv(key, value, k_cache, v_cache, slots)

    assert torch.equal(k_cache[1, 1:7], key) and torch.equal(v_cache[1, 1:7], value)
    untouched = torch.ones(3, block_size, dtype=torch.bool)
    untouched[1, 1:7] = False
    assert k_cache[untouched].isnan().all() and v_cache[untouched].isnan().all()


def test_write_kv_with_only_padding_writes_nothing() -> None:
    k_cache = torch.full((2, 4, 1, 16), float("nan"), device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    ones = torch.ones(3, 1, 16, device=DEVICE)
    write_kv(ones, ones, k_cache, v_cache, torch.full((3,), -1, dtype=torch.int64, device=DEVICE))
    assert k_cache.isnan().all() and v_cache.isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_copies_every_pair_in_every_layer_and_touches_nothing_else(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    shape = (9, 5, 2, 32)  # odd block size: a block is 320 elements, not a power of two
    caches = [(random_cache(shape, dtype, gen), random_cache(shape, dtype, gen)) for _ in range(3)]
    pairs = torch.tensor([[2, 7], [0, 3], [8, 1], [2, 5]], dtype=torch.int64)  # one source copied twice
    expected = [(k.clone(), v.clone()) for k, v in caches]
    for k, v in expected:
        for src, dst in pairs.tolist():
            k[dst], v[dst] = k[src].clone(), v[src].clone()

    copy_blocks(caches, pairs.to(DEVICE), chunk=128)  # several chunks per block

    for (k, v), (ek, ev) in zip(caches, expected, strict=True):
        assert torch.equal(bits(k), bits(ek)) and torch.equal(bits(v), bits(ev))


def test_copy_blocks_with_no_pairs_is_a_no_op() -> None:
    k = torch.randn(2, 4, 1, 16, device=DEVICE)
    before = k.clone()
    copy_blocks([(k, k)], torch.empty((0, 2), dtype=torch.int64))
    assert torch.equal(k, before)


def test_copy_blocks_rejects_layers_with_different_layouts() -> None:
    a = torch.zeros(4, 8, 2, 16, device=DEVICE)
    b = torch.zeros(4, 8, 2, 16, device=DEVICE, dtype=torch.float16)
    with pytest.raises(ValueError, match="layer 1"):
        copy_blocks([(a, a), (b, b)], torch.tensor([[0, 1]]))
