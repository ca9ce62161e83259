"""The GGUF block formats pagedkv keeps quantized (``Q8_0``, ``Q4_0``, ``Q4_1``) and their de-quantization in torch.

Each format cuts a weight row into blocks of 32 values; a block is its fp16 scale ``d`` (and, for ``Q4_1``, an
fp16 offset ``m``) followed by the 32 quantized values (llama.cpp's ``ggml-common.h``):

- ``Q8_0``: 34 bytes, 32 int8 ``q``, value ``d * q``;
- ``Q4_0``: 18 bytes, 16 bytes of nibbles, value ``d * (q - 8)``;
- ``Q4_1``: 20 bytes, 16 bytes of nibbles, value ``d * q + m``.

In a nibble byte ``i`` the low four bits are value ``i`` of the block and the high four bits value ``i + 16``. A
weight ``[out, in]`` is stored as ``[out, in / 32 * block_bytes]`` uint8, row after row, as the file holds it. The
arithmetic here (fp16 scales widened exactly, then one multiply and one add in fp32) gives the same floats as the
``gguf`` package's ``dequantize``, so the engine on the blocks and on their fp32 de-quantization see one model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # values per block, every format here


@dataclass(frozen=True)
class QuantFormat:
    name: str
    code: int  # the C kernel's number for it (quant_linear.h)
    block_bytes: int


FORMATS = {f.name: f for f in (QuantFormat("Q8_0", 0, 34), QuantFormat("Q4_0", 1, 18), QuantFormat("Q4_1", 2, 20))}


def row_bytes(qtype: str, in_features: int) -> int:
    """Bytes of one weight row of ``in_features`` values (a multiple of 32) in ``qtype``."""
    if in_features % BLOCK:
        raise ValueError(f"{qtype} rows hold whole blocks of {BLOCK} values, not {in_features}")
    return in_features // BLOCK * FORMATS[qtype].block_bytes


def _half(raw: torch.Tensor) -> torch.Tensor:
    """``[..., 2]`` little-endian fp16 bytes -> ``[..., 1]`` float32 (exact)."""
    return raw.contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[..., 16]`` nibble bytes -> ``[..., 32]`` values 0..15: the low nibbles, then the high ones."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def dequantize(blocks: torch.Tensor, qtype: str, in_features: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[rows, row_bytes]`` uint8 blocks -> ``[rows, in_features]`` values in ``dtype`` (computed in fp32)."""
    fmt = FORMATS[qtype]
    rows = blocks.shape[0]
    b = blocks.reshape(rows, in_features // BLOCK, fmt.block_bytes)
    d = _half(b[..., 0:2])
    if qtype == "Q8_0":
        out = b[..., 2:].contiguous().view(torch.int8).to(torch.float32) * d
    elif qtype == "Q4_0":
        out = d * (_nibbles(b[..., 2:]).to(torch.int8) - 8).to(torch.float32)
    else:
        out = d * _nibbles(b[..., 4:]).to(torch.float32) + _half(b[..., 2:4])
    return out.reshape(rows, in_features).to(dtype)
