"""The 2-byte bfloat16 row scale main used before the 1-byte E5M3 one, for accuracy comparisons only.

``kv_quant_accuracy.py --scale-format bf16`` installs it in place of ``core/kv/kv_dtype.py``'s format for
the torch reference backend (the only one the benchmark runs), so both formats are measured by the same
script on the same prompts: rows of ``head_dim + 2`` elements, the last two the scale
``bf16_rne(amax / QMAX)`` (0 for a zero row), values ``round_half_even(x / scale)`` clamped to QMAX.
"""

from __future__ import annotations

import torch

from pagedkv.backends.torch_ref import attention
from pagedkv.core.kv import kv_dtype

SCALE_ELEMS = 2


def split_cache(cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Values ``[..., head_dim]`` and bfloat16 scales ``[...]`` of rows ``[..., head_dim + 2]``."""
    return cache[..., :head_dim], cache[..., head_dim:].view(torch.bfloat16)[..., 0]


def quantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    qmax = kv_dtype.QMAX[dtype]
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
    values, scales = split_cache(rows, head_dim)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return (values.to(compute) * scales.to(compute)[..., None]).to(dtype)


def install() -> None:
    """Make the torch backend and the cache allocation use this format for the rest of the process."""
    kv_dtype.SCALE_ELEMS = SCALE_ELEMS
    attention.quantize_rows = quantize_rows
    attention.dequantize_rows = dequantize_rows
