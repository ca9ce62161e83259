"""The repacked layout :class:`~.quant_linear.QuantLinear` holds a GGUF-block weight in (made once at load; the cpu
backend's ``quant_packed.h`` reads it), and its exact inverse.

The file stores a weight ``[out, in]`` row after row of 32-value blocks, each block its fp16 scale ``d`` (Q4_1: and
offset ``m``) then its values (:mod:`.quant_formats`). Here the rows go in groups of :data:`GROUP` (the last group
has the ``out % GROUP`` rest), and a group of ``w`` rows is, in order: every block's values, the ``w`` rows' values
side by side for each block (``blocks x w x value_bytes``); the scales ``d`` (``blocks x w`` fp16); for Q4_1 the
offsets ``m`` (``blocks x w`` fp16). The bytes are the file's, moved: a group takes ``w x row_bytes`` bytes, the
weight keeps its ``[out, row_bytes]`` uint8 shape and size, and :func:`unpack` gives back the file's bytes exactly.

Why: the kernel then reads a row's block values 16-byte aligned and the scales of a tile's rows with one load and
one conversion (the file's 34 / 18 / 20-byte blocks made it compute-bound: benchmarks/JOURNAL.md).
"""

from __future__ import annotations

import torch

from pagedkv.core.model.quant_formats import BLOCK, FORMATS, row_bytes

GROUP = 8  # weight rows a group (quant_packed.h's kGroup)


def _halves(qtype: str) -> int:
    """Leading bytes of a file block before its values: fp16 d, and Q4_1's fp16 m."""
    return 4 if qtype == "Q4_1" else 2


def _pack_groups(rows: torch.Tensor, qtype: str) -> torch.Tensor:
    """File rows ``[groups, w, blocks, block_bytes]`` -> packed groups ``[groups, w * row_bytes]``."""
    groups, width, blocks, _ = rows.shape
    head = _halves(qtype)
    parts = [rows[..., head:].transpose(1, 2)]  # values: [groups, blocks, w, value_bytes]
    parts += [rows[..., i:i + 2].transpose(1, 2) for i in range(0, head, 2)]  # d, m: [groups, blocks, w, 2]
    return torch.cat([p.reshape(groups, -1) for p in parts], dim=1)


def _unpack_groups(packed: torch.Tensor, qtype: str, width: int, blocks: int) -> torch.Tensor:
    """Packed groups ``[groups, w * row_bytes]`` -> file rows ``[groups, w, blocks, block_bytes]``."""
    groups = packed.shape[0]
    head = _halves(qtype)
    values = FORMATS[qtype].block_bytes - head
    sizes = [blocks * width * values] + [blocks * width * 2] * (head // 2)
    parts = torch.split(packed, sizes, dim=1)
    shaped = [parts[0].reshape(groups, blocks, width, values)]
    shaped += [p.reshape(groups, blocks, width, 2) for p in parts[1:]]
    return torch.cat([*shaped[1:], shaped[0]], dim=3).transpose(1, 2)


def _split(n: int) -> tuple[int, int]:
    """Rows in whole groups, and the last group's rows (0: none)."""
    full = n // GROUP * GROUP
    return full, n - full


def pack(blocks: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """File-layout ``[out, row_bytes]`` uint8 blocks -> the packed layout, same shape (a new tensor)."""
    n = blocks.shape[0]
    nb, bb = in_features // BLOCK, FORMATS[qtype].block_bytes
    if tuple(blocks.shape) != (n, row_bytes(qtype, in_features)):
        raise ValueError(f"{qtype} blocks {list(blocks.shape)} are not [out, {row_bytes(qtype, in_features)}]")
    full, rest = _split(n)
    out = torch.empty_like(blocks, memory_format=torch.contiguous_format)
    if full:
        rows = blocks[:full].reshape(full // GROUP, GROUP, nb, bb)
        out[:full] = _pack_groups(rows, qtype).reshape(full, -1)
    if rest:
        out[full:] = _pack_groups(blocks[full:].reshape(1, rest, nb, bb), qtype).reshape(rest, -1)
    return out


def unpack(packed: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """The inverse of :func:`pack`: the file's bytes, ``[out, row_bytes]``."""
    return packed_rows(packed, qtype, in_features, torch.arange(packed.shape[0]))


def packed_rows(packed: torch.Tensor, qtype: str, in_features: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (1-D) of a packed weight in the file's layout, ``[len(ids), row_bytes]``: each id's group is
    unpacked (an embedding lookup reads GROUP rows per id: a few KB)."""
    n, rb = packed.shape
    nb = in_features // BLOCK
    full, rest = _split(n)
    out = torch.empty((ids.numel(), rb), dtype=torch.uint8)
    ids = ids.reshape(-1)
    whole = ids < full
    if whole.any():
        sel = ids[whole]
        groups = packed[:full].reshape(full // GROUP, GROUP * rb).index_select(0, sel // GROUP)
        rows = _unpack_groups(groups, qtype, GROUP, nb).reshape(-1, GROUP, rb)
        out[whole] = rows[torch.arange(sel.numel()), sel % GROUP]
    if rest and not whole.all():
        tail = _unpack_groups(packed[full:].reshape(1, -1), qtype, rest, nb).reshape(rest, rb)
        out[~whole] = tail[ids[~whole] - full]
    return out
