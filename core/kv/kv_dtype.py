"""The KV cache's storage dtype (``--kv-cache-dtype``) and the 8-bit row format every backend shares.

``auto`` stores K/V in the model dtype (as before); ``bfloat16`` / ``float16`` store a cast; ``int8``,
``fp8_e4m3`` and ``fp8_e5m2`` quantize. A quantized cache keeps the paged layout and adds two bytes to
every (token, KV head) row: ``[num_blocks, block_size, Hkv, head_dim + 2]`` in the 8-bit dtype, where the
last two bytes are that row's scale as bfloat16. The scale sits inside the block it scales, so every block
operation (copy-on-write copies, CPU swap, prefix reuse, a tensor-parallel rank's share of the heads)
moves data and scales together without knowing about them, and a cache tensor describes itself: its
dtype says whether and how it is quantized, ``shape[-1] - head_dim`` says where the scale is.

Why per (token, KV head) and not per (block, KV head): a token's scale is final when the token is
written, so the write is one pass over the new rows; a per-block scale grows as the block fills and
would re-quantize the block's earlier rows (twice-rounded) or clip them. The cost is 2 bytes per 64
(head_dim 64): 3.88x the fp32 tokens per byte instead of 3.98x; RESULTS.md has the accuracy figures.

Quantization (the reference every backend's KV-write matches bit for bit): ``scale = bf16(amax / QMAX)``
(0 for an all-zero row); ``q = round_half_even(x / scale)`` clamped to ``[-QMAX, QMAX]`` for int8,
``fp8(clamp(x / scale))`` for fp8. Dequantized, ``q * scale`` is exact in float32 (an 8-bit integer or a
3-bit fp8 mantissa times an 8-bit bfloat16 mantissa), so every backend reads the same K/V.
"""

from __future__ import annotations

import torch

from pagedkv.core.config import KV_CACHE_DTYPES

SCALE_ELEMS = 2  # one bfloat16 scale per row, as two 8-bit elements
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The flag's name for a storage dtype (``float32`` for the model dtype default)."""
    for name, candidate in KV_CACHE_DTYPES.items():
        if candidate == dtype:
            return name
    return str(dtype).replace("torch.", "")


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements per (token, KV head) row of a cache of ``dtype``: the values, then a quantized row's scale."""
    return head_dim + (SCALE_ELEMS if is_quantized(dtype) else 0)


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as int8 (same bytes), for the copies, scatters and fills torch has no fp8 kernel for."""
    return tensor.view(torch.int8) if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else tensor


def split_cache(cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a quantized cache (or gathered rows) ``[..., head_dim + 2]``: values ``[..., head_dim]`` in the
    8-bit dtype and scales ``[...]`` as bfloat16. Writes through either view land in the cache."""
    return cache[..., :head_dim], cache[..., head_dim:].view(torch.bfloat16)[..., 0]


def quantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``rows`` ``[..., D]`` (any float dtype) as packed quantized rows ``[..., D + 2]`` of ``dtype``."""
    qmax = QMAX[dtype]
    x = rows.float()
    scale = (x.abs().amax(-1) / qmax).to(torch.bfloat16)
    divisor = scale.float()
    divisor = torch.where(divisor > 0, divisor, torch.ones_like(divisor))
    y = (x / divisor[..., None]).clamp(-qmax, qmax)
    packed = torch.empty((*rows.shape[:-1], rows.shape[-1] + SCALE_ELEMS), dtype=dtype, device=rows.device)
    values, scales = split_cache(packed, rows.shape[-1])
    values.copy_(y.round() if dtype == torch.int8 else y)
    scales.copy_(scale)
    return packed


def dequantize_rows(rows: torch.Tensor, head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed quantized rows ``[..., head_dim + 2]`` as ``dtype`` values ``[..., head_dim]`` (exact in float32)."""
    values, scales = split_cache(rows, head_dim)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return (values.to(compute) * scales.to(compute)[..., None]).to(dtype)
