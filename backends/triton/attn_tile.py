"""The inner loop shared by the paged attention kernels: online softmax over a range of cached keys.

A program holds ``BLOCK_M`` query rows (query tokens x the query heads of one KV
head, so every K/V tile is read once for the whole GQA group) and walks the keys
``[kv_start, kv_end)`` of one sequence in tiles of ``TILE_N`` positions. Each
position is mapped to its physical block through the block table, so any cache
block size works and a tile may span several blocks. Addresses are int64.

An 8-bit cache (``QUANT``) is dequantized right after loading, each row times its scale, decoded from the
row's E5M3 byte by integer operations (``e5m3_scale``; exact in fp32, as the torch reference). Everything
is converted to fp32 right after loading: the interpreter computes bf16 arithmetic wrongly, and fp32
accumulation is what the GPU wants as well.
Scores are kept in base 2: ``q @ k^T`` is multiplied by ``qk_scale = scale * log2(e)``
after the dot, so a 16-bit ``q`` stays exact when the dot runs in TF32 on a GPU.
With softcapping the score is ``softcap * tanh(scale * q.k / softcap)``, so the
kernels pass ``qk_scale = scale / softcap`` and ``cap_log2e = softcap * log2(e)``.
A sliding ``window`` hides keys at or below ``q_pos - window``; callers also
start ``kv_start`` at the first position any of their rows can see.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Kernels here call only triton.language *builtins* (and these reductions over
# triton's own combine functions) rather than its @jit helpers such as tl.zeros,
# tl.max, tl.sum or tl.cdiv. Those helpers are compiled-mode JITFunctions when
# triton.language was imported before TRITON_INTERPRET=1 was set (transformers
# imports triton while building a model), and the interpreter cannot call them.
# The interpreter recognises these two combine functions and reduces with numpy.


@triton.jit
def max_along(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def sum_along(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision="tf32")


def interpreted() -> bool:
    """Whether these kernels run through Triton's interpreter (decided when this module was imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(online_softmax_over_kv, InterpretedFunction)


@triton.jit
def e5m3_scale(code):
    """An 8-bit row's scale byte (uint8) as its fp32 scale (``core/kv/kv_dtype.py``, SCALE_BIAS 22): the bits
    are ``(code << 20) + ((127 - 22) << 23)``; code 0 reads as 0.0 (a zero row), 255 as NaN (a non-finite one)."""
    c = code.to(tl.uint32)
    bits = (c << 20) + (105 << 23)
    bits = tl.where(c == 255, 0x7FC00000, bits)
    bits = tl.where(c == 0, 0, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _tanh(x):
    # tanh from exp (a builtin everywhere; the libdevice tanh is GPU-only): exact sign, no overflow.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _kv_tile(
    start,
    q,
    acc,
    m_i,
    l_i,
    qk_scale,
    cap_log2e,
    q_pos,
    q_lo,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_table_ptr,
    k_head,
    v_head,
    stride_kb,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vd,
    kv_end,
    offs_n,
    offs_d,
    d_mask,
    BLOCK_SIZE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QUANT: tl.constexpr,
):
    pos = start + offs_n
    n_mask = pos < kv_end
    block = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    in_block = (pos % BLOCK_SIZE).to(tl.int64)
    tile_mask = n_mask[:, None] & d_mask[None, :]

    k_rows = block * stride_kb + in_block * stride_ks + k_head
    k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :] * stride_kd, mask=tile_mask, other=0.0)
    k = k.to(tl.float32)
    if QUANT:  # an 8-bit row's scale byte follows its values (core/kv/kv_dtype.py)
        k = k * e5m3_scale(tl.load(k_scale_ptr + k_rows + HEAD_DIM, mask=n_mask, other=0))[:, None]
    s = _dot(q, tl.trans(k), IEEE)  # [BLOCK_M, TILE_N]
    if SOFTCAP:
        s = _tanh(s * qk_scale) * cap_log2e
    else:
        s = s * qk_scale
    visible = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_lo[:, None]) & n_mask[None, :]
    s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, max_along(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at 0
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + sum_along(p, 1)

    v_rows = block * stride_vb + in_block * stride_vs + v_head
    v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :] * stride_vd, mask=tile_mask, other=0.0)
    v = v.to(tl.float32)
    if QUANT:
        v = v * e5m3_scale(tl.load(v_scale_ptr + v_rows + HEAD_DIM, mask=n_mask, other=0))[:, None]
    acc = acc * alpha[:, None] + _dot(p, v, IEEE)
    return acc, m_new, l_i


@triton.jit
def online_softmax_over_kv(
    q,  # [BLOCK_M, D_PAD] fp32, unscaled; padded rows/columns are 0
    acc,  # [BLOCK_M, D_PAD] fp32, unnormalised output so far
    m_i,  # [BLOCK_M] fp32, running max (base 2), -inf when nothing seen yet
    l_i,  # [BLOCK_M] fp32, running sum of exp2(score - m_i)
    qk_scale,  # scale * log2(e); with SOFTCAP: scale / softcap
    cap_log2e,  # softcap * log2(e) (used only with SOFTCAP)
    q_pos,  # [BLOCK_M] int32, absolute position of each row: it sees keys at positions <= q_pos
    window,  # sliding window: a row sees keys > q_pos - window; 0 = no window
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,  # with QUANT: the K cache's bytes as uint8 (each row's scale code), else unused
    v_scale_ptr,
    block_table_ptr,  # this sequence's row of the block table
    kv_head,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    kv_start,
    kv_end,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
    INTERPRET: tl.constexpr,
    QUANT: tl.constexpr,
):
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, D_PAD).to(tl.int64)
    d_mask = offs_d < HEAD_DIM
    k_head = kv_head.to(tl.int64) * stride_kh
    v_head = kv_head.to(tl.int64) * stride_vh
    q_lo = tl.where(window > 0, q_pos - window, -1)
    if INTERPRET:
        # The interpreter runs `range` in Python, which turns the bounds into ints; Triton 3.6's interpreter does
        # that with int() on a 1-element array, an error since numpy 2.4. A while loop only asks for a bool.
        start = kv_start
        while start < kv_end:
            acc, m_i, l_i = _kv_tile(
                start, q, acc, m_i, l_i, qk_scale, cap_log2e, q_pos, q_lo, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                v_scale_ptr, block_table_ptr, k_head, v_head, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs,
                stride_vd, kv_end, offs_n, offs_d, d_mask, BLOCK_SIZE, SOFTCAP, IEEE, HEAD_DIM, QUANT,
            )
            start += TILE_N
    else:
        for start in range(kv_start, kv_end, TILE_N):
            acc, m_i, l_i = _kv_tile(
                start, q, acc, m_i, l_i, qk_scale, cap_log2e, q_pos, q_lo, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                v_scale_ptr, block_table_ptr, k_head, v_head, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs,
                stride_vd, kv_end, offs_n, offs_d, d_mask, BLOCK_SIZE, SOFTCAP, IEEE, HEAD_DIM, QUANT,
            )
    return acc, m_i, l_i


@triton.jit
def attend_rows(
    q_ptr,
    q_rows,  # [BLOCK_M] int64, each row's offset in q: token * stride_qt + head * stride_qh
    row_mask,  # [BLOCK_M] the real rows (padding rows load 0 and are never stored)
    stride_qd,
    qk_scale,
    cap_log2e,
    q_pos,
    window,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_table_ptr,
    kv_head,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    kv_start,
    kv_end,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
    INTERPRET: tl.constexpr,
    QUANT: tl.constexpr,
):
    """A program's query rows, loaded as fp32, through the online softmax over keys ``[kv_start, kv_end)``.

    Returns ``(acc, m_i, l_i)`` of :func:`online_softmax_over_kv`, started from nothing seen.
    """
    offs_d = tl.arange(0, D_PAD).to(tl.int64)
    mask = row_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :] * stride_qd, mask=mask, other=0.0).to(tl.float32)
    acc = tl.full([BLOCK_M, D_PAD], 0.0, dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    return online_softmax_over_kv(
        q, acc, m_i, l_i, qk_scale, cap_log2e, q_pos, window, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
        block_table_ptr, kv_head, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh,
        stride_vd, kv_start, kv_end, HEAD_DIM, D_PAD, BLOCK_SIZE, TILE_N, SOFTCAP, IEEE, INTERPRET, QUANT,
    )
