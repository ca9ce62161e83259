"""``write_kv`` (reshape-and-cache): scatter each new token's K and V rows to its cache slot.

One program per token writes all of its KV heads; slot ``-1`` (padding) is skipped.
No arithmetic touches the values: a row is loaded, converted to the cache dtype
(a no-op when the dtypes match, so the write is bit-exact) and stored.

An int8 cache (``QUANT``) quantizes in the same program, bit for bit as ``core/kv/kv_dtype.py``: the row's
E5M3 scale code from ``amax / 127`` by integer arithmetic on its float32 bits (rounded up to 3 mantissa
bits), ``x / scale``, clamped and rounded half to even, and the code stored in the byte after the row; both
divisions IEEE-rounded (``div_rn``). fp8 caches are written by the reference's op (the interpreter's fp8
casts do not round to nearest); the kernels read them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.backends.triton.attn_tile import e5m3_scale, max_along
from pagedkv.core.kv.kv_dtype import is_quantized, row_width


@triton.jit
def _scale_code(a):
    """fp32 ``a >= 0`` -> the E5M3 code of the smallest scale on its grid >= a: the bits rounded up to 3 mantissa
    bits and rebiased (SCALE_BIAS 22), clamped to [1, 254]; 0 for 0, 255 for inf/NaN."""
    bits = a.to(tl.uint32, bitcast=True).to(tl.int64)
    code = tl.minimum(tl.maximum(((bits + 0xFFFFF) >> 20) - (105 << 3), 1), 254)
    code = tl.where(bits >= 0x7F800000, 255, code)
    return tl.where(a == 0.0, 0, code)


@triton.jit
def _store_int8_rows(x, cache_ptr, scale_ptr, rows, offs_d, stride_d, mask, h_mask, HEAD_DIM: tl.constexpr):
    """Quantize rows ``x`` ``[H_PAD, D_PAD]`` (masked lanes 0) into int8 values plus an E5M3 scale byte each."""
    x = x.to(tl.float32)
    # div_rn, not ``/``: Triton compiles an fp32 ``/`` to div.full.f32 (up to 2 ulp off), which can push an
    # amax / 127 that lies on the scale grid to the next code; the reference divides IEEE-rounded.
    code = _scale_code(tl.math.div_rn(max_along(tl.abs(x), 1), 127.0))
    scale = e5m3_scale(code)
    divisor = tl.where(scale > 0.0, scale, 1.0)  # a zero or NaN scale divides by 1
    y = tl.math.div_rn(x, divisor[:, None])
    y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    y = (y + 12582912.0) - 12582912.0  # 1.5 * 2**23: rounds |y| < 2**22 half to even in float32
    tl.store(cache_ptr + rows[:, None] + offs_d[None, :] * stride_d, y.to(tl.int8), mask=mask)
    tl.store(scale_ptr + rows + HEAD_DIM, code.to(tl.uint8), mask=h_mask)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,  # with QUANT: the caches' bytes as uint8 (each row's scale code)
    v_scale_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, H_PAD).to(tl.int64)
    offs_d = tl.arange(0, D_PAD).to(tl.int64)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask,
                other=0.0)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask,
                other=0.0)
    k_rows = block * stride_kcb + offset * stride_kcs + offs_h * stride_kch
    v_rows = block * stride_vcb + offset * stride_vcs + offs_h * stride_vch
    if QUANT:
        h_mask = offs_h < NUM_KV_HEADS
        _store_int8_rows(k, k_cache_ptr, k_scale_ptr, k_rows, offs_d, stride_kcd, mask, h_mask, HEAD_DIM)
        _store_int8_rows(v, v_cache_ptr, v_scale_ptr, v_rows, offs_d, stride_vcd, mask, h_mask, HEAD_DIM)
    else:
        k_dst = k_cache_ptr + k_rows[:, None] + offs_d[None, :] * stride_kcd
        v_dst = v_cache_ptr + v_rows[:, None] + offs_d[None, :] * stride_vcd
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` (any strides) into caches ``[num_blocks, block_size, Hkv, row]``
    (``row``: ``D``, or ``D + 1`` for an 8-bit cache)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    if k_cache.shape[2:] != (num_kv_heads, row_width(head_dim, k_cache.dtype)) or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not hold rows {tuple(key.shape)}")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    if num_tokens == 0:
        return
    quant = is_quantized(k_cache.dtype)
    if quant and k_cache.dtype != torch.int8:
        from pagedkv.backends.torch_ref.attention import write_kv as reference_write_kv

        reference_write_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        k_cache.view(torch.uint8) if quant else k_cache,
        v_cache.view(torch.uint8) if quant else v_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        H_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        QUANT=quant,
    )
