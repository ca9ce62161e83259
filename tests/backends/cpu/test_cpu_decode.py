"""The cpu backend's decode kernel (units of one query token) against the float64 reference.

`attention.cpp` sends every unit with a single query token and a head dim that is a whole number
of vectors (32, 64, 128, 256) to `decode.h`: one vector of keys per step (16 on AVX-512, 8 on AVX2,
4 on the generic build; every build this CPU runs is tested, see the ``backend`` fixture), rows
prefetched a few steps ahead, query heads in passes of up to 4 (AVX-512: 2 at head dim 128, 1 at 256;
AVX2: 1 from head dim 64). These cases cross its step and prefetch-ring edges of every width, split
groups into several passes, and take both unit shapes: all KV heads
per unit (many sequences) and one KV head per unit (too few sequences to go round the threads),
with one thread and several (a decode-only step splits its units into per-thread ranges of equal key
counts, run in order, so a unit prefetches the next unit's first rows on any thread count). Other head dims
take the general kernel; one case checks that they still do.
"""

from __future__ import annotations

import pytest
import torch
from test_cpu_backend import backend, check  # noqa: F401 - the fixture is used by name

# The first nine cross the step edges of every width (4, 8, 16 keys) and the 32-key prefetch distance.
STEP_EDGES = [1, 4, 5, 8, 9, 16, 17, 32, 33, 2, 3, 7, 15, 31, 47, 48, 49, 64, 65, 100, 257]
MANY = 9  # sequences: enough units to keep every KV head of a sequence in one unit (up to 2 threads)


@pytest.mark.parametrize("dim", [32, 64, 128, 256, 48, 80])
@pytest.mark.parametrize("num_seqs", [1, MANY])
def test_decode_across_step_and_prefetch_edges(backend, dim, num_seqs):  # noqa: F811
    lengths = (STEP_EDGES * 2)[:num_seqs] if num_seqs > 1 else [97]
    check(backend, lengths, [1] * len(lengths), 16, heads=6, kv_heads=3, dim=dim, seed=dim + num_seqs)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 7, 8, 12])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_decode_query_head_passes(backend, group, dim):  # noqa: F811
    check(backend, [40, 1, 77, 16, 33, 200, 5, 18, 64], [1] * 9, 16, heads=2 * group, kv_heads=2, dim=dim,
          seed=group * dim)


@pytest.mark.parametrize("block_size", [1, 3, 16, 256])
def test_decode_block_sizes(backend, block_size):  # noqa: F811
    check(backend, STEP_EDGES[:MANY], [1] * MANY, block_size, heads=9, kv_heads=3, seed=block_size)
    check(backend, [300], [1], block_size, heads=9, kv_heads=3, seed=block_size + 1)


@pytest.mark.parametrize("window", [1, 5, 16, 17, 40])
def test_decode_sliding_window(backend, window):  # noqa: F811
    check(backend, STEP_EDGES[:MANY], [1] * MANY, 8, heads=4, kv_heads=2, window=window, seed=window)


@pytest.mark.parametrize("softcap", [0.5, 5.0, 50.0])
def test_decode_softcap(backend, softcap):  # noqa: F811
    check(backend, STEP_EDGES[:MANY], [1] * MANY, 16, heads=4, kv_heads=2, softcap=softcap,
          query=lambda q: q * 8, seed=7)
    check(backend, [90, 3], [1, 1], 16, heads=4, kv_heads=2, softcap=softcap, window=20, query=lambda q: q * 8,
          seed=8)


@pytest.mark.parametrize("dim", [64, 128])
def test_decode_bfloat16(backend, dim):  # noqa: F811
    check(backend, STEP_EDGES[:MANY], [1] * MANY, 16, heads=9, kv_heads=3, dim=dim, dtype=torch.bfloat16)


def test_single_token_tail_of_a_prefill_tile(backend):  # noqa: F811
    # query tile 16: a 17- or 33-token chunk ends in a one-token unit, which the decode kernel takes
    check(backend, [17, 50, 33], [17, 17, 33], 16, heads=6, kv_heads=2, seed=11)
    check(backend, [50, 33], [17, 33], 16, heads=6, kv_heads=2, window=9, seed=12)


def test_decode_large_logits_do_not_overflow(backend):  # noqa: F811
    # the running max is taken per 16 keys: a later, much larger score must rescale what came before
    check(backend, [200, 70], [1, 1], 16, heads=4, kv_heads=2, query=lambda q: q * 40, seed=13)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_decode_on_one_to_three_threads(backend, threads):  # noqa: F811
    # each thread's units prefetch their neighbour's first rows: neighbours of all shapes
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check(backend, STEP_EDGES, [1] * len(STEP_EDGES), 16, heads=9, kv_heads=3, seed=threads)
        check(backend, [300, 20, 40], [1, 17, 1], 16, heads=4, kv_heads=2, window=24, seed=threads + 2)
        # one long sequence holds most of the keys: a thread's range is that one unit, another's may be empty
        check(backend, [2000, 1, 2, 1, 3, 1], [1] * 6, 16, heads=4, kv_heads=2, seed=threads + 4)
    finally:
        torch.set_num_threads(old)
