"""The torch reference backend against a float64 naive attention over contiguous tokens."""

from __future__ import annotations

import math

import pytest
import torch
from attention_cases import make_case, reference

from pagedkv.backends.torch_ref import TorchBackend
from pagedkv.backends.torch_ref.attention import copy_blocks, swap_blocks, write_kv
from pagedkv.core.kv.attention_metadata import AttentionMetadata


def check(seq_lens, query_lens, block_size, dtype=torch.float32, tol=2e-5, **kw):
    meta, q, k_cache, v_cache, keys, values = make_case(seq_lens, query_lens, block_size, dtype=dtype, **kw)
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = TorchBackend("cpu").attend(q, k_cache, v_cache, meta, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all(), "NaN from unused cache slots leaked into the output"
    start = 0
    for n, q_len, k, v in zip(seq_lens, query_lens, keys, values):
        expected = reference(q[start : start + q_len], k, v, n - q_len, scale)
        torch.testing.assert_close(out[start : start + q_len].double(), expected, atol=tol, rtol=tol)
        start += q_len


@pytest.mark.parametrize("length", [1, 15, 16, 17, 130])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_decode_matches_float64_reference(length, block_size):
    check([length, 3, length + 5], [1, 1, 1], block_size)


@pytest.mark.parametrize("length", [1, 15, 16, 17, 130])
def test_full_prefill_is_causal(length):
    check([length], [length], 16)


def test_mixed_batch_of_decodes_and_chunked_prefills_with_context():
    # a decode, a prefill chunk after cached context, a fresh prefill, a chunk ending mid-block
    check([40, 37, 16, 9], [1, 20, 16, 9], 8)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_gqa_groups_share_kv_heads(kv_heads):
    check([17, 33], [1, 5], 16, heads=4, kv_heads=kv_heads)


def test_bfloat16_cache_is_computed_in_float32():
    check([17, 40], [1, 7], 16, dtype=torch.bfloat16, tol=2e-2)


def test_write_kv_scatters_by_slot_and_skips_minus_one():
    k_cache = torch.zeros(4, 4, 2, 8)
    v_cache = torch.zeros(4, 4, 2, 8)
    key = torch.randn(3, 2, 8)
    value = torch.randn(3, 2, 8)
    slots = torch.tensor([13, -1, 2])
    write_kv(key, value, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache[3, 1], key[0])
    torch.testing.assert_close(v_cache[0, 2], value[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2  # only the two real slots were written


def test_copy_blocks_copies_one_source_to_many_destinations():
    caches = [(torch.randn(5, 4, 2, 8), torch.randn(5, 4, 2, 8)) for _ in range(2)]
    before = [(k.clone(), v.clone()) for k, v in caches]
    copy_blocks(caches, torch.tensor([[1, 3], [1, 4]]))
    for (k, v), (k0, v0) in zip(caches, before):
        for dst in (3, 4):
            assert torch.equal(k[dst], k0[1]) and torch.equal(v[dst], v0[1])
        assert torch.equal(k[:3], k0[:3])


def test_swap_blocks_moves_blocks_between_caches():
    src = [(torch.randn(4, 2, 1, 4), torch.randn(4, 2, 1, 4))]
    dst = [(torch.zeros(3, 2, 1, 4), torch.zeros(3, 2, 1, 4))]
    swap_blocks(src, dst, torch.tensor([[3, 0], [1, 2]]))
    assert torch.equal(dst[0][0][0], src[0][0][3]) and torch.equal(dst[0][1][2], src[0][1][1])
    assert torch.equal(dst[0][0][1], torch.zeros(2, 1, 4))


def test_metadata_rejects_a_table_too_short_for_its_tokens():
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.build(block_tables=[[0]], context_lens=[10], query_lens=[1], block_size=8)
