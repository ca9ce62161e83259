"""The KV cache's storage dtype (``--kv-cache-dtype``) and the 8-bit row format every backend shares.

``auto`` stores K/V in the model dtype (as before); ``bfloat16`` / ``float16`` store a cast; ``int8``,
``fp8_e4m3`` and ``fp8_e5m2`` quantize. A quantized cache keeps the paged layout and adds one byte to
every (token, KV head) row: ``[num_blocks, block_size, Hkv, head_dim + 1]`` in the 8-bit dtype, where the
last byte is that row's scale code. The scale sits inside the block it scales, so every block operation
(copy-on-write copies, CPU swap, prefix reuse, a tensor-parallel rank's share of the heads) moves data and
scales together without knowing about them, and a cache tensor describes itself: its dtype says whether
and how it is quantized, ``shape[-1] - head_dim`` says where the scale is.

Why per (token, KV head) and not per (block, KV head): a token's scale is final when the token is
written, so the write is one pass over the new rows; a per-block scale grows as the block fills and
would re-quantize the block's earlier rows (twice-rounded) or clip them.

Why a 1-byte E5M3 scale: one byte per 64 values (head_dim 64) gives 3.94x the fp32 tokens per byte, where
a bfloat16 scale's 2 bytes gave 3.88x (issue 29 asks for 3.9x). The scale is rounded *up* to the byte's
grid, so ``x / scale`` never exceeds QMAX (nothing clips), at the price of unused int8 range: with 3
mantissa bits the grid steps by at most 1/8, so at worst 12.5% of the range (0.17 bit) and on average
4.6% (log-uniform amax) is lost, where a power-of-two (E8M0) byte loses up to half the range (1 bit; mean logit error
1.7x bfloat16's on SmolLM2) and bfloat16's rounding to nearest about 0.4% (but it clips by up to that).
The code is unsigned: ``e = code >> 3``, ``m = code & 7``, ``scale = 2^(e - SCALE_BIAS) * (1 + m / 8)``,
whose float32 bits are ``(code << 20) + ((127 - SCALE_BIAS) << 23)``: every backend decodes it with a
shift and an add, and encodes it by rounding the float32 bits of ``amax / QMAX`` up to 3 mantissa bits,
integer arithmetic only (no log2/exp2 whose last bit differs between libraries). Code 0 is a zero row;
code 255 is NaN, so a non-finite row (an overflowed model) reads back non-finite as it would unquantized
instead of being clipped into plausible values. ``q * scale`` is exact in float32 (an 8-bit value times a
4-bit mantissa), so every backend reads the same K/V. Measured on SmolLM2 (64 prompts x 128 tokens,
RESULTS.md): int8's mean logit error is 1.07x the bfloat16 scale's, teacher-forced agreement 99.0% vs 99.2%;
fp8 pays more (e5m2 1.23x), its peak no longer landing on the format's largest value.

Why SCALE_BIAS 22: finite scales span [1.125 * 2^-22, 1.75 * 2^9 = 896], which holds ``amax / QMAX`` of
every dtype with room on both sides. SmolLM2's K/V rows have amax 0.045 to ~28 (30 layers, 512 tokens of
``benchmarks/data/kv_quant_text.txt``): int8 scales 2^-11.5 to 2^-2.2, fp8_e4m3 2^-13 to 2^-4, fp8_e5m2
2^-20.3 to 2^-11. The top is 12 binades above int8's largest and fits every float16 row of every dtype
(int8 clips only rows with amax > 896 * 127 = 113,792; float16's largest is 65,504). At the bottom an int8
row keeps its full range down to amax = 127 * 2^-22 = 3e-5 (10 binades below SmolLM2's smallest), and fp8
loses nothing there at all: below the smallest scale its own exponent carries the small values.

Quantization (the reference every backend's KV-write matches bit for bit): ``a = float32(amax / QMAX)``;
``code = 0`` if ``a == 0``, ``255`` if ``a`` is inf/NaN, else ``clamp(((bits(a) + 0xFFFFF) >> 20) -
((127 - SCALE_BIAS) << 3), 1, 254)``; ``q = round_half_even(x / scale)`` clamped to ``[-QMAX, QMAX]``
for int8, ``fp8(clamp(x / scale))`` for fp8 (the division IEEE-rounded; a zero or NaN scale divides by 1).
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
    a = amax.float() / qmax
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
