"""Sliding window and softcapping in the torch and Triton backends against a float64 reference.

Caches are NaN-poisoned outside the written rows (the ``Batch`` of
``test_triton_attention``), block tables shuffled; windows cut across block
edges, tiles and splits, including windows of 1 and longer than the history.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedkv.backends.torch_ref import TorchBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def naive(q, k, v, context_len: int, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """float64 attention of one sequence, with transformers' window rule ``q - window < k <= q``."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = context_len + torch.arange(q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= k_pos <= q_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def expected(batch, window, softcap) -> torch.Tensor:
    rows, start = [], 0
    query = batch.query.cpu()
    for (q_len, ctx), k, v in zip(batch.specs, batch.keys, batch.values, strict=True):
        rows.append(naive(query[start : start + q_len], k, v, ctx, batch.scale, window, softcap))
        start += q_len
    return torch.cat(rows)


def check(batch, out: torch.Tensor, window, softcap, tol: float = 2e-5) -> None:
    assert not out.isnan().any(), "a row was not written or read a poisoned slot"
    torch.testing.assert_close(out.cpu().double(), expected(batch, window, softcap), atol=tol, rtol=tol)


def make_batch(specs, heads=(4, 2), head_dim=16, block_size=4, seed=0):
    pytest.importorskip("triton")  # Batch lives in the Triton test module (it only builds tensors)
    from test_triton_attention import Batch

    return Batch(specs, heads=heads, head_dim=head_dim, block_size=block_size, seed=seed)


MIXED = [(1, 30), (7, 9), (12, 0), (1, 0)]
CASES = [(None, 2.0), (1, None), (5, None), (8, 3.0), (64, None)]  # (window, softcap)


@pytest.mark.parametrize(("window", "softcap"), CASES)
def test_torch_backend_window_and_softcap_match_reference(window, softcap):
    batch = make_batch(MIXED, seed=3)
    out = TorchBackend(DEVICE).attend(
        batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale, window=window, softcap=softcap
    )
    check(batch, out, window, softcap)


def test_torch_backend_without_window_or_cap_is_unchanged():
    batch = make_batch(MIXED, seed=4)
    plain = TorchBackend(DEVICE).attend(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    check(batch, plain, None, None)


@pytest.mark.parametrize(("window", "softcap"), [(None, 2.0), (1, None), (5, 3.0), (64, None)])
def test_triton_paged_attention_window_and_softcap_match_reference(window, softcap):
    batch = make_batch(MIXED, seed=5)
    out = batch.run_paged(window=window, softcap=softcap, tile_n=16)
    check(batch, out, window, softcap)


@pytest.mark.parametrize(("window", "softcap"), [(None, 2.0), (7, None), (40, 3.0)])
def test_triton_split_kv_decode_window_and_softcap_match_reference(window, softcap):
    from pagedkv.backends.triton.split_kv_decode import split_kv_decode

    batch = make_batch([(1, 70), (1, 3), (1, 33)], seed=6)
    m = batch.meta
    out = batch.poisoned_out()
    split_kv_decode(
        batch.query, batch.k_cache, batch.v_cache, m.block_tables, m.seq_lens, m.query_start_loc, m.max_seq_len,
        batch.scale, 3, out=out, tile_n=16, window=window, softcap=softcap,
    )  # fmt: skip
    check(batch, out, window, softcap)


def test_copy_grid_puts_the_pair_count_on_axis_0():
    pytest.importorskip("triton")
    from pagedkv.backends.triton.copy_blocks import copy_grid

    grid = copy_grid(200_000, 32, 16 * 8 * 128, 1024)
    assert grid == (200_000, 32, 16)
    with pytest.raises(ValueError, match="65,535"):
        copy_grid(1, 70_000, 16, 16)


@pytest.mark.parametrize("window", [1, 3, 6])
def test_torch_mask_is_transformers_sliding_window_mask(window):
    """The off-by-one that matters: our mask equals transformers' own mask function, key by key."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    from pagedkv.backends.torch_ref.attention import step_mask
    from pagedkv.core.kv.attention_metadata import AttentionMetadata

    hf = sliding_window_causal_mask_function(window)
    # one prefill of 5 tokens after 9 cached ones: query positions 9..13 over keys 0..13
    meta = AttentionMetadata.build(block_tables=[[0, 1, 2, 3]], context_lens=[9], query_lens=[5], block_size=4)
    ours = step_mask(meta, torch.device("cpu"), window)[0, 0]
    zero = torch.tensor(0)
    want = hf(zero, zero, 9 + torch.arange(5)[:, None], torch.arange(14)[None, :]).expand(5, 14)
    assert torch.equal(ours, want)
