"""The KV cache's storage dtype (``--kv-cache-dtype``) and the 8-bit row format every backend shares.

A quantized cache adds one scale byte (an unsigned E5M3 code) to every (token, KV head) row, inside the
block it scales, so block copies, swaps and prefix reuse carry scales without knowing about them. The
code is encoded and decoded with integer arithmetic only, so every backend writes and reads the same
bits; :func:`quantize_rows` here is the reference each backend's KV write matches. The format, its
reasons and its measurements: ``docs/kv_format.md``.
"""

from __future__ import annotations

import torch

from pagedkv.core.config import KV_CACHE_DTYPES

SCALE_ELEMS = 1  # one E5M3 scale code per row
SCALE_BIAS = 22  # scale = 2^((code >> 3) - SCALE_BIAS) * (1 + (code & 7) / 8)
SCALE_NAN = 255  # the code of a non-finite row's scale
_SCALE_OFFSET = (127 - SCALE_BIAS) << 23  # float32 bits of a scale = (code << 20) + _SCALE_OFFSET
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
    """Views of a quantized cache (or gathered rows) ``[..., head_dim + 1]``: values ``[..., head_dim]`` in the
    8-bit dtype and scale codes ``[...]`` as uint8. Writes through either view land in the cache."""
    return cache[..., :head_dim], cache[..., head_dim].view(torch.uint8)


def scale_code(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """The E5M3 code (int64) of the smallest scale on the byte's grid >= ``float32(amax / qmax)``: its float32
    bits rounded up to 3 mantissa bits, rebiased. 0 for a zero row, SCALE_NAN for a non-finite one."""
    amax = amax.float()
    a = amax / torch.full_like(amax, qmax)  # not "/ qmax": CUDA torch multiplies by 1/qmax then (1 ulp off)
    bits = a.view(torch.int32).to(torch.int64)  # amax >= 0 (or NaN): the sign bit is clear
    code = (((bits + 0xFFFFF) >> 20) - ((127 - SCALE_BIAS) << 3)).clamp(1, SCALE_NAN - 1)
    code = torch.where(bits >= 0x7F800000, SCALE_NAN, code)
    return torch.where(a == 0, 0, code)


def decode_scales(codes: torch.Tensor) -> torch.Tensor:
    """E5M3 codes (any integer dtype holding 0..255) as float32 scales, exactly (0 -> 0.0, SCALE_NAN -> NaN)."""
    c = codes.to(torch.int32) & 0xFF
    scales = ((c << 20) + _SCALE_OFFSET).view(torch.float32)
    scales = torch.where(c == SCALE_NAN, float("nan"), scales)
    return torch.where(c == 0, 0.0, scales)


def quantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``rows`` ``[..., D]`` (any float dtype) as packed quantized rows ``[..., D + 1]`` of ``dtype``."""
    qmax = QMAX[dtype]
    x = rows.float()
    code = scale_code(x.abs().amax(-1), qmax)
    divisor = decode_scales(code)
    divisor = torch.where(divisor > 0, divisor, torch.ones_like(divisor))
    y = (x / divisor[..., None]).clamp(-qmax, qmax)
    packed = torch.empty((*rows.shape[:-1], rows.shape[-1] + SCALE_ELEMS), dtype=dtype, device=rows.device)
    values, codes = split_cache(packed, rows.shape[-1])
    values.copy_(y.round() if dtype == torch.int8 else y)
    codes.copy_(code)
    return packed


def dequantize_rows(rows: torch.Tensor, head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed quantized rows ``[..., head_dim + 1]`` as ``dtype`` values ``[..., head_dim]`` (exact in float32)."""
    values, codes = split_cache(rows, head_dim)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return (values.to(compute) * decode_scales(codes).to(compute)[..., None]).to(dtype)
