"""Triton paged attention (mixed batch and split-KV decode) against a float64 contiguous reference.

Runs on CPU through Triton's interpreter, so shapes are small. The caches are
filled directly (not through ``write_kv``) with every unused slot NaN, block
tables are shuffled, and outputs are written into NaN-poisoned buffers.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from pagedkv.backends.triton.paged_attention import paged_attention, rows_per_program  # noqa: E402
from pagedkv.backends.triton.split_kv_decode import choose_num_splits, split_kv_decode, split_layout  # noqa: E402
from pagedkv.core.kv.attention_metadata import AttentionMetadata  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, scale: float) -> torch.Tensor:
    """float64 causal attention of one sequence: ``q`` ``[Q, H, D]`` over its whole history ``[L, Hkv, D]``."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = context_len + torch.arange(q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class Batch:
    """One step's packed queries, a NaN-padded paged cache with a shuffled block table, and the truth."""

    def __init__(
        self,
        specs: list[tuple[int, int]],  # (query_len, context_len) per sequence
        heads: tuple[int, int],
        head_dim: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        shared_blocks: int = 0,  # sequence 1 reuses sequence 0's first blocks (a shared prefix)
        fused_qkv: bool = False,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        num_heads, num_kv_heads = heads
        lens = [q + c for q, c in specs]
        needed = [-(-n // block_size) for n in lens]
        num_blocks = sum(needed) - shared_blocks + 3  # spare blocks stay NaN
        order = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: list[list[int]] = []
        for i, n in enumerate(needed):
            own = n - (shared_blocks if i == 1 else 0)
            table, order = order[:own], order[own:]
            if i == 1 and shared_blocks:
                assert min(specs[0][1], specs[1][1]) >= shared_blocks * block_size, "shared blocks must be context"
                table = self.tables[0][:shared_blocks] + table
            self.tables.append(table)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dtype)

        self.keys = [rand(n, num_kv_heads, head_dim) for n in lens]
        self.values = [rand(n, num_kv_heads, head_dim) for n in lens]
        if shared_blocks:
            rows = shared_blocks * block_size
            self.keys[1][:rows], self.values[1][:rows] = self.keys[0][:rows], self.values[0][:rows]
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
        for table, k, v in zip(self.tables, self.keys, self.values, strict=True):
            for pos in range(k.shape[0]):
                self.k_cache[table[pos // block_size], pos % block_size] = k[pos]
                self.v_cache[table[pos // block_size], pos % block_size] = v[pos]

        num_tokens = sum(q for q, _ in specs)
        if fused_qkv:  # q is a strided view, as when q/k/v come out of one projection
            # sliced on DEVICE: moving a strided view to another device copies it into a contiguous tensor
            self.query = rand(num_tokens, num_heads + 2 * num_kv_heads, head_dim).to(DEVICE)[:, :num_heads]
        else:
            self.query = rand(num_tokens, num_heads, head_dim)
        self.specs = specs
        self.scale = head_dim**-0.5
        self.meta = AttentionMetadata.build(
            block_tables=self.tables,
            context_lens=[c for _, c in specs],
            query_lens=[q for q, _ in specs],
            block_size=block_size,
            device=DEVICE,
        )
        self.k_cache, self.v_cache, self.query = self.k_cache.to(DEVICE), self.v_cache.to(DEVICE), self.query.to(DEVICE)

    def expected(self) -> torch.Tensor:
        rows, start = [], 0
        query = self.query.cpu()
        for (q_len, ctx), k, v in zip(self.specs, self.keys, self.values, strict=True):
            rows.append(naive_attention(query[start : start + q_len], k, v, ctx, self.scale))
            start += q_len
        return torch.cat(rows)

    def poisoned_out(self) -> torch.Tensor:
        return torch.full(self.query.shape, float("nan"), dtype=self.query.dtype, device=DEVICE)

    def run_paged(self, **kwargs) -> torch.Tensor:
        m = self.meta
        out = self.poisoned_out()
        result = paged_attention(
            self.query, self.k_cache, self.v_cache, m.block_tables, m.seq_lens, m.context_lens,
            m.query_start_loc, m.max_query_len, self.scale, out=out, **kwargs,
        )  # fmt: skip
        assert result is out
        return out

    def check(self, out: torch.Tensor) -> None:
        assert not out.isnan().any(), "output has NaN: a row was not written or read a poisoned slot"
        tol = TOLERANCE[self.query.dtype]
        torch.testing.assert_close(out.cpu().double(), self.expected(), atol=tol, rtol=tol)


@pytest.mark.parametrize("block_size", [8, 16, 32, 5, 1])
def test_decode_lengths_around_block_edges_match_reference(block_size: int) -> None:
    batch = Batch([(1, n - 1) for n in (1, 15, 16, 17, 70)], heads=(4, 4), head_dim=64, block_size=block_size)
    batch.check(batch.run_paged())


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (5, 1), (32, 1)])
def test_gqa_groups_share_one_kv_head_per_program(heads: tuple[int, int]) -> None:
    batch = Batch([(1, 40), (6, 11), (17, 0)], heads=heads, head_dim=64, block_size=16, seed=1)
    batch.check(batch.run_paged())


def test_mixed_decode_and_prefill_chunks_in_one_launch() -> None:
    batch = Batch([(1, 1328), (5, 18), (129, 463)], heads=(8, 2), head_dim=64, block_size=16, seed=2)
    batch.check(batch.run_paged())


@pytest.mark.parametrize("block_size", [8, 5])
def test_chunked_prefill_with_context_not_block_aligned_and_an_idle_sequence(block_size: int) -> None:
    batch = Batch([(7, 13), (20, 3), (0, 10), (3, 29)], heads=(4, 2), head_dim=64, block_size=block_size, seed=3)
    batch.check(batch.run_paged())


def test_first_prefill_without_context_is_causal() -> None:
    batch = Batch([(33, 0), (1, 0)], heads=(2, 1), head_dim=64, block_size=16, seed=4)
    batch.check(batch.run_paged())


def test_sequences_sharing_physical_prefix_blocks() -> None:
    batch = Batch([(1, 40), (9, 35)], heads=(4, 2), head_dim=64, block_size=8, shared_blocks=4, seed=5)
    assert batch.tables[0][:4] == batch.tables[1][:4]
    batch.check(batch.run_paged())


@pytest.mark.parametrize("head_dim", [128, 80])
def test_head_dims_including_non_power_of_two(head_dim: int) -> None:
    batch = Batch([(1, 30), (4, 9)], heads=(4, 2), head_dim=head_dim, block_size=16, seed=6)
    batch.check(batch.run_paged())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cache_dtypes_each_within_their_tolerance(dtype: torch.dtype) -> None:
    batch = Batch([(1, 50), (12, 20)], heads=(8, 2), head_dim=64, block_size=16, dtype=dtype, seed=7)
    out = batch.run_paged()
    assert out.dtype == dtype
    batch.check(out)


def test_query_as_strided_view_of_fused_qkv() -> None:
    batch = Batch([(1, 21), (6, 10)], heads=(4, 2), head_dim=64, block_size=16, fused_qkv=True, seed=8)
    assert not batch.query.is_contiguous() and batch.query.stride(0) == (4 + 2 * 2) * 64  # a view of fused rows
    assert batch.query.device.type == torch.device(DEVICE).type
    batch.check(batch.run_paged())


def test_small_key_tile_spans_many_tiles_and_blocks() -> None:
    batch = Batch([(1, 100), (19, 30)], heads=(4, 1), head_dim=64, block_size=5, seed=9)
    batch.check(batch.run_paged(tile_n=16))


def test_rows_per_program_keep_dot_dimensions_at_least_16() -> None:
    for group_pad in (1, 2, 4, 8, 16, 32, 64):
        for max_query_len in (1, 2, 300):
            assert rows_per_program(group_pad, max_query_len) * group_pad >= 16


# ---- split-KV (flash-decoding) ----------------------------------------------------------------


def run_split(batch: Batch, num_splits: int, tile_n: int = 64) -> tuple[torch.Tensor, torch.Tensor, int]:
    m = batch.meta
    split_len, used = split_layout(m.max_seq_len, num_splits, tile_n)
    num_heads, head_dim = batch.query.shape[1:]
    part_out = torch.full((m.num_seqs, used, num_heads, head_dim), float("nan"), device=DEVICE)
    part_lse = torch.full((m.num_seqs, used, num_heads), float("nan"), device=DEVICE)
    out = batch.poisoned_out()
    split_kv_decode(
        batch.query, batch.k_cache, batch.v_cache, m.block_tables, m.seq_lens, m.query_start_loc,
        m.max_seq_len, batch.scale, num_splits, out=out, part_out=part_out, part_lse=part_lse, tile_n=tile_n,
    )  # fmt: skip
    return out, part_lse, split_len


def test_split_kv_decode_skips_empty_splits_of_short_sequences() -> None:
    # Splits of 256 keys over max length 1329: the 1-, 17- and 300-long sequences leave 5, 5 and 4 splits empty.
    batch = Batch([(1, n - 1) for n in (1, 17, 300, 1329)], heads=(8, 2), head_dim=64, block_size=16, seed=10)
    out, part_lse, split_len = run_split(batch, num_splits=6)
    assert split_len == 256 and part_lse.shape[1] == 6
    batch.check(out)  # the reduce never read the NaN scratch of an empty split
    for seq, length in enumerate(batch.meta.seq_lens_cpu):
        used = -(-length // split_len)
        assert not part_lse[seq, :used].isnan().any()
        assert part_lse[seq, used:].isnan().all(), "an empty split was written"


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("heads", [(4, 4), (5, 1)])
def test_split_kv_decode_matches_reference_for_any_split_count(num_splits: int, heads: tuple[int, int]) -> None:
    batch = Batch([(1, 600), (1, 63), (1, 16)], heads=heads, head_dim=64, block_size=16, seed=11)
    out, _, _ = run_split(batch, num_splits=num_splits, tile_n=32)
    batch.check(out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_split_kv_decode_half_precision_caches(dtype: torch.dtype) -> None:
    batch = Batch([(1, 200), (1, 40)], heads=(8, 2), head_dim=64, block_size=8, dtype=dtype, seed=12)
    out, _, _ = run_split(batch, num_splits=4, tile_n=32)
    assert out.dtype == dtype
    batch.check(out)


def test_split_kv_decode_rejects_prefill_rows() -> None:
    batch = Batch([(2, 5)], heads=(2, 2), head_dim=64, block_size=8)
    with pytest.raises(ValueError, match="one query token per sequence"):
        run_split(batch, num_splits=2)


def test_split_count_grows_only_for_long_contexts_with_few_sequences() -> None:
    assert choose_num_splits(num_seqs=1, num_kv_heads=2, max_seq_len=100) == 1
    assert choose_num_splits(num_seqs=1, num_kv_heads=2, max_seq_len=8192) == 32
    assert choose_num_splits(num_seqs=64, num_kv_heads=8, max_seq_len=2048) == 1
    assert choose_num_splits(num_seqs=4, num_kv_heads=8, max_seq_len=2048) == 8
