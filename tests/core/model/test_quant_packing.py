"""The load-time repack of GGUF blocks (``core/model/quant_packing.py``, read by the cpu kernel's quant_packed.h):
it round-trips exactly for row counts that are not a multiple of the group and k not a multiple of 256, keeps the
size, puts each byte where the layout says (checked against offsets computed here, not by the inverse), and
``QuantLinear`` / ``QuantEmbedding`` hold it (a tied head shares its embedding's bytes) with the same values."""

from __future__ import annotations

import pytest
import torch

from pagedkv.core.model.quant_formats import FORMATS, dequantize, row_bytes
from pagedkv.core.model.quant_linear import QuantEmbedding, QuantLinear
from pagedkv.core.model.quant_packing import GROUP, pack, packed_rows, unpack

ROW_COUNTS = [1, 5, 8, 13, 16, 21]  # under, at and past a group
IN_FEATURES = [32, 96, 288]  # 1, 3, 9 blocks: none a multiple of 256 values


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, row_bytes(qtype, k)), dtype=torch.uint8, generator=gen)
    per = blocks.view(n, k // 32, FORMATS[qtype].block_bytes)
    per[..., 1] &= 0x3B  # finite fp16 scales and offsets (exponent < 31), so values compare as numbers
    if qtype == "Q4_1":
        per[..., 3] &= 0x3B
    return blocks


@pytest.mark.parametrize("qtype", list(FORMATS))
@pytest.mark.parametrize("k", IN_FEATURES)
@pytest.mark.parametrize("n", ROW_COUNTS)
def test_pack_round_trips_exactly_and_keeps_the_size(qtype, n, k):
    blocks = random_blocks(qtype, n, k, seed=n * 100 + k)
    packed = pack(blocks, qtype, k)
    assert packed.shape == blocks.shape and packed.dtype == torch.uint8
    assert torch.equal(unpack(packed, qtype, k), blocks)
    assert torch.equal(packed.flatten().sort().values, blocks.flatten().sort().values)  # the same bytes, moved
    ids = torch.tensor([n - 1, 0, n // 2, n - 1])
    assert torch.equal(packed_rows(packed, qtype, k, ids), blocks[ids])


@pytest.mark.parametrize("qtype", list(FORMATS))
def test_each_byte_lands_where_the_layout_says(qtype):
    """Group g of width w at byte g * GROUP * row_bytes: values (blocks x w x value bytes), then d (blocks x w
    fp16), then Q4_1's m; offsets computed from that description for a 13-row weight (a full group and a 5-row one)."""
    n, k = 13, 96
    blocks = random_blocks(qtype, n, k, seed=5)
    flat = pack(blocks, qtype, k).reshape(-1)
    nb, bb = k // 32, FORMATS[qtype].block_bytes
    head = 4 if qtype == "Q4_1" else 2
    vb, rb = bb - head, row_bytes(qtype, k)
    for row in range(n):
        g, c = divmod(row, GROUP)
        width = min(GROUP, n - g * GROUP)
        base = g * GROUP * rb
        for b in range(nb):
            src = blocks[row, b * bb:(b + 1) * bb]
            at = base + (b * width + c) * vb
            assert torch.equal(flat[at:at + vb], src[head:]), (row, b)
            at = base + nb * width * vb + (b * width + c) * 2
            assert torch.equal(flat[at:at + 2], src[0:2]), (row, b)
            if qtype == "Q4_1":
                at += nb * width * 2
                assert torch.equal(flat[at:at + 2], src[2:4]), (row, b)


@pytest.mark.parametrize("qtype", list(FORMATS))
def test_quant_layers_hold_the_packed_blocks_with_the_file_values(qtype):
    n, k = 21, 96
    blocks = random_blocks(qtype, n, k, seed=9)
    want = dequantize(blocks, qtype, k)
    linear = QuantLinear(blocks, qtype, k, n)
    assert torch.equal(linear.blocks, pack(blocks, qtype, k))
    assert torch.equal(linear.dequantized(), want)
    embedding = QuantEmbedding(blocks, qtype, k, torch.float32)
    ids = torch.tensor([[20, 3], [8, 7]])
    assert torch.equal(embedding(ids), want[ids])
    head = embedding.as_linear()
    assert head.blocks.data_ptr() == embedding.blocks.data_ptr()  # tied: one copy, not packed twice
    assert torch.equal(head.dequantized(), want)
