"""GPU checks of the CuPy backend's kernels (skipped without a CUDA device).

Run on a GPU machine with ``pytest tests/backends/cupy/test_cupy_gpu.py``. The checks are
plain functions taking a backend and a device (the tests below call them with
``CupyBackend`` on ``cuda``), compared against a float64 reference computed
straight from the definition, and against the torch reference backend.
Unused cache slots are NaN, so reading one (the tail of a sequence's last
block, a block it does not own) poisons the output.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from pagedkv.core.kv.attention_metadata import AttentionMetadata

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the cupy backend is CUDA-only)"),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (atol, rtol) of a backend's output against the float64 reference computed from the same rounded inputs:
# what remains is fp32 accumulation and the rounding of the output itself.
TOLERANCE = {torch.float32: (2e-5, 1e-4), torch.float16: (2e-3, 4e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
NAN = float("nan")


# ---------------------------------------------------------------------- cases


@dataclass
class Case:
    query: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    tables: list[list[int]]
    context_lens: list[int]
    query_lens: list[int]
    scale: float


def make_case(
    *,
    context_lens: list[int],
    query_lens: list[int],
    block_size: int = 16,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float16,
    device: torch.device | str = "cuda",
    seed: int = 0,
    spare_blocks: int = 5,
) -> Case:
    """Random queries and a NaN-poisoned cache whose only finite rows are the sequences' history.

    Block ids are shuffled, so no sequence owns contiguous or ordered blocks.
    """
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil((c + q) / block_size) for c, q in zip(context_lens, query_lens)]
    num_blocks = sum(needed) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    for n in needed:
        tables.append(perm[i : i + n])
        i += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, NAN, dtype=dtype)
    v_cache = torch.full(shape, NAN, dtype=dtype)
    for table, ctx, q in zip(tables, context_lens, query_lens):
        for pos in range(ctx + q):
            b, off = table[pos // block_size], pos % block_size
            k_cache[b, off] = torch.randn((num_kv_heads, head_dim), generator=gen).to(dtype)
            v_cache[b, off] = torch.randn((num_kv_heads, head_dim), generator=gen).to(dtype)
    query = torch.randn((sum(query_lens), num_heads, head_dim), generator=gen).to(dtype)
    meta = AttentionMetadata.build(
        block_tables=tables, context_lens=context_lens, query_lens=query_lens, block_size=block_size, device=device
    )
    return Case(
        query=query.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        meta=meta,
        tables=tables,
        context_lens=context_lens,
        query_lens=query_lens,
        scale=1.0 / math.sqrt(head_dim),
    )


def naive_attention(case: Case, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal paged attention from the definition, in float64 on the CPU, one sequence at a time.

    ``window``: a query at position p sees keys p - window < k <= p; ``softcap``: scores become cap * tanh(s / cap).
    """
    q = case.query.double().cpu()
    k_cache, v_cache = case.k_cache.double().cpu(), case.v_cache.double().cpu()
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.full_like(q, NAN)
    start = 0
    for table, ctx, q_len in zip(case.tables, case.context_lens, case.query_lens):
        seq_len = ctx + q_len
        pos = torch.arange(seq_len)
        blocks = torch.tensor(table, dtype=torch.long)[pos // block_size]
        keys = k_cache[blocks, pos % block_size].repeat_interleave(group, dim=1)  # [L, H, D]
        values = v_cache[blocks, pos % block_size].repeat_interleave(group, dim=1)
        rows = q[start : start + q_len]  # [Q, H, D]
        scores = torch.einsum("qhd,khd->hqk", rows, keys) * case.scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = (ctx + torch.arange(q_len))[:, None]
        allowed = pos[None, :] <= q_pos  # bottom-right causal
        if window is not None:
            allowed &= pos[None, :] > q_pos - window
        scores = scores.masked_fill(~allowed[None], -math.inf)
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values)
        start += q_len
    return out


def poison_allocator(device: torch.device | str, nbytes: int = 64 << 20) -> None:
    """Best effort: fill memory the allocator will hand out next with NaN, so rows a kernel skips stay NaN."""
    junk = torch.full((nbytes // 4,), NAN, dtype=torch.float32, device=device)
    del junk


def assert_close_to(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    assert got.dtype == dtype
    assert not torch.isnan(got).any(), f"{what}: NaN in the output (a poisoned slot was read or a row never written)"
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double().cpu(), want, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------- checks (backend, device)


def check_window_softcap(backend, device, dtype, window=None, softcap=None, partition=None) -> None:
    """Decodes (one spanning several partitions) and prefill chunks with a sliding window and/or softcapping."""
    case = make_case(context_lens=[150, 40, 0, 9], query_lens=[1, 1, 37, 20], num_heads=8, num_kv_heads=2,
                     head_dim=64, dtype=dtype, device=device, seed=11)
    backend.partition_size = partition
    try:
        out = backend.attend(case.query, case.k_cache, case.v_cache, case.meta, case.scale, window=window,
                             softcap=softcap)
    finally:
        backend.partition_size = None
    assert_close_to(out, naive_attention(case, window, softcap), dtype, f"window={window} softcap={softcap}")


def check_attention(backend, device, **case_args) -> Case:
    case = make_case(device=device, **case_args)
    poison_allocator(device)
    out = backend.attend(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    assert out.shape == case.query.shape
    assert_close_to(out, naive_attention(case), case.query.dtype, repr(case_args))
    return case


def check_decode_lengths(backend, device, dtype, block_size=16, head_dim=64, heads=(8, 2), long=1000):
    lengths = [1, 15, 16, 17, 33, long]
    check_attention(
        backend, device, context_lens=[n - 1 for n in lengths], query_lens=[1] * len(lengths), dtype=dtype,
        block_size=block_size, head_dim=head_dim, num_heads=heads[0], num_kv_heads=heads[1],
    )  # fmt: skip


def check_prefill(backend, device, dtype, block_size=16, head_dim=64, heads=(8, 2)):
    # fresh prompts (no context) of awkward lengths, and chunks with cached context
    check_attention(
        backend, device, context_lens=[0, 0, 0, 0, 17, 40, 5], query_lens=[2, 15, 16, 17, 33, 9, 64], dtype=dtype,
        block_size=block_size, head_dim=head_dim, num_heads=heads[0], num_kv_heads=heads[1],
    )  # fmt: skip


def check_mixed(backend, device, dtype, block_size=16, head_dim=64, heads=(8, 2), long=700):
    # decodes (query 1) and prefill chunks (query > 1) in one packed step, one decode long enough to split
    check_attention(
        backend, device, context_lens=[5, 0, long, 16, 0, 31], query_lens=[1, 20, 1, 7, 1, 2], dtype=dtype,
        block_size=block_size, head_dim=head_dim, num_heads=heads[0], num_kv_heads=heads[1],
    )  # fmt: skip


def check_matches_torch_reference(backend, device, dtype, head_dim=64, heads=(8, 2), block_size=16):
    from pagedkv.backends.torch_ref import TorchBackend

    case = make_case(
        context_lens=[0, 9, 300, 1], query_lens=[12, 1, 1, 30], block_size=block_size, num_heads=heads[0],
        num_kv_heads=heads[1], head_dim=head_dim, dtype=dtype, device=device,
    )  # fmt: skip
    ours = backend.attend(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    ref = TorchBackend(device).attend(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(ours.double(), ref.double(), atol=2 * atol, rtol=2 * rtol)


def check_noncontiguous_query(backend, device, dtype):
    case = make_case(context_lens=[3, 20], query_lens=[5, 1], dtype=dtype, device=device)
    # the model hands over [1, H, T, D] transposed: same values, other strides
    strided = case.query.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    out = backend.attend(strided, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_close_to(out, naive_attention(case), dtype, "strided query")


def check_write_kv(backend, device, dtype, block_size=16, num_kv_heads=2, head_dim=64):
    gen = torch.Generator().manual_seed(7)
    num_blocks, tokens = 6, 11
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, NAN, dtype=dtype, device=device)
    v_cache = torch.full(shape, NAN, dtype=dtype, device=device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[2, 5, 10]] = -1
    # [1, Hkv, T, D] -> [T, Hkv, D] views, as the model produces them (not contiguous)
    key = torch.randn((1, num_kv_heads, tokens, head_dim), generator=gen).to(dtype).to(device)[0].transpose(0, 1)
    value = torch.randn((1, num_kv_heads, tokens, head_dim), generator=gen).to(dtype).to(device)[0].transpose(0, 1)
    backend.write_kv(key, value, k_cache, v_cache, slots.to(device))
    want_k = torch.full(shape, NAN, dtype=dtype).view(-1, num_kv_heads, head_dim)
    want_v = want_k.clone()
    keep = slots >= 0
    want_k[slots[keep]] = key.cpu()[keep]
    want_v[slots[keep]] = value.cpu()[keep]
    assert torch.equal(k_cache.cpu().view(-1, num_kv_heads, head_dim).nan_to_num(7.0), want_k.nan_to_num(7.0))
    assert torch.equal(v_cache.cpu().view(-1, num_kv_heads, head_dim).nan_to_num(7.0), want_v.nan_to_num(7.0))


def check_write_kv_8bit(backend, device, dtype, kv_dtype="int8", block_size=16, num_kv_heads=2, head_dim=64):
    """An 8-bit cache (``kv_dtype``: int8, float8_e4m3fn, float8_e5m2): the kernel's bytes (values and scales)
    equal the torch reference's write, and attention over it equals a float64 attention over the dequantized
    rows."""
    from pagedkv.backends.torch_ref.attention import write_kv as reference_write_kv
    from pagedkv.core.kv.kv_dtype import byte_view, dequantize_rows

    kv_dtype = getattr(torch, kv_dtype)
    gen = torch.Generator().manual_seed(11)
    num_blocks, tokens = 6, 2 * block_size
    shape = (num_blocks, block_size, num_kv_heads, head_dim + 1)
    key = torch.randn((tokens, num_kv_heads, head_dim), generator=gen) * torch.logspace(-3, 3, tokens)[:, None, None]
    key[3, 0] = 0.0  # a zero row: scale 0
    key[4, -1] = torch.linspace(-127.0, 127.0, head_dim) * 1.875  # amax / 127 on the scale grid: that scale
    key[5, 0] = key[4, -1] * (1 + 2**-20)  # just above it: the next code
    key[2, 0] *= 1e-36  # amax / 127 below the smallest scale: the smallest code
    value = torch.randn((tokens, num_kv_heads, head_dim), generator=gen)
    key, value = key.to(dtype), value.to(dtype)
    slots = torch.cat([torch.arange(block_size) + 4 * block_size, torch.arange(block_size) + block_size])

    def junk() -> torch.Tensor:
        return torch.full(shape, 9, dtype=torch.int8).view(kv_dtype)

    k_cache, v_cache = junk().to(device), junk().to(device)
    with kernels_only("write_kv"):
        backend.write_kv(key.to(device), value.to(device), k_cache, v_cache, slots.to(device))
    want_k, want_v = junk(), junk()
    reference_write_kv(key, value, want_k, want_v, slots)
    assert torch.equal(byte_view(k_cache).cpu(), byte_view(want_k))
    assert torch.equal(byte_view(v_cache).cpu(), byte_view(want_v))
    seq_len = tokens - 5
    meta = AttentionMetadata.build(block_tables=[[4, 1]], context_lens=[seq_len - 1], query_lens=[1],
                                   block_size=block_size, device=device)
    query = torch.randn((1, 2 * num_kv_heads, head_dim), generator=gen).to(dtype)
    out = backend.attend(query.to(device), k_cache, v_cache, meta, 0.125).cpu().double()
    k = dequantize_rows(want_k[[4, 1]].reshape(tokens, num_kv_heads, -1)[:seq_len], head_dim, torch.float64)
    v = dequantize_rows(want_v[[4, 1]].reshape(tokens, num_kv_heads, -1)[:seq_len], head_dim, torch.float64)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    probs = (torch.einsum("hd,khd->hk", query[0].double(), k) * 0.125).softmax(-1)
    expected = torch.einsum("hk,khd->hd", probs, v)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out[0], expected, atol=atol, rtol=rtol)


def check_fp8_write_rounding(backend, device, dtype, kv_dtype):
    """Every fp8 value, every midpoint between neighbours (ties go to the even code) and points just off them,
    written by the kernel from ``dtype`` (float32: every point exact): bytes equal the reference's. Each row
    starts with the format's largest value, so its scale is exactly 1 and its values reach the rounding as
    they are."""
    from pagedkv.backends.torch_ref.attention import write_kv as reference_write_kv
    from pagedkv.core.kv.kv_dtype import QMAX, byte_view

    kv_dtype = getattr(torch, kv_dtype)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(kv_dtype).float()
    grid = codes[torch.isfinite(codes) & (codes >= 0)].unique().sort().values.double()
    mids = (grid[1:] + grid[:-1]) / 2
    pool = torch.cat([grid, mids, mids * (1 + 2**-20), mids * (1 - 2**-20), grid[1:] * (1 - 2**-22)])
    pool = torch.cat([pool, -pool]).float()
    head_dim = 64
    rows = -(-pool.numel() // (head_dim - 1))
    pool = torch.cat([pool, torch.zeros(rows * (head_dim - 1) - pool.numel())]).view(rows, 1, head_dim - 1)
    key = torch.cat([torch.full((rows, 1, 1), QMAX[kv_dtype]), pool], dim=-1).to(dtype)
    shape = (rows, 1, 1, head_dim + 1)
    k_cache = torch.zeros(shape, dtype=kv_dtype, device=device)
    v_cache = torch.zeros(shape, dtype=kv_dtype, device=device)
    slots = torch.arange(rows)
    with kernels_only("write_kv"):
        backend.write_kv(key.to(device), key.to(device), k_cache, v_cache, slots.to(device))
    want_k, want_v = torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype)
    reference_write_kv(key, key, want_k, want_v, slots)
    got, want = byte_view(k_cache).cpu().view(-1), byte_view(want_k).view(-1)
    bad = (got != want).nonzero()[:5].view(-1).tolist()
    assert not bad, f"{kv_dtype}: bytes {got[bad].tolist()} where the reference writes {want[bad].tolist()}"
    assert torch.equal(byte_view(v_cache).cpu(), byte_view(want_v))


def check_8bit_scale_edges(backend, device, dtype, kv_dtype):
    """Rows whose amax sits on the edges of the scale code (``dtype`` float32 or bfloat16, which have
    subnormals): float32(amax / QMAX) is 0 (code 0) up to an amax of QMAX / 2 subnormal steps and the
    smallest code 1 just above; the largest subnormal and smallest normal amax; an amax whose quotient is
    the smallest normal, or the smallest scale, and the floats around them; an infinite row. The bytes
    equal the reference's: the kernels decide these on integer bits, as the GPU (-ftz=true) flushes every
    subnormal operand of a float instruction to zero."""
    from pagedkv.backends.torch_ref.attention import write_kv as reference_write_kv
    from pagedkv.core.kv.kv_dtype import QMAX, byte_view

    kv_dtype = getattr(torch, kv_dtype)
    qmax = QMAX[kv_dtype]
    half = int(qmax // 2)  # IEEE rounds m * 2^-149 / qmax to 0 for m <= qmax / 2
    bits = [0, 1, half - 1, half, half + 1, 0x7FFFFF, 0x800000]
    for boundary in (qmax * 2.0**-126, qmax * 1.125 * 2.0**-22):  # quotient = the smallest normal / scale
        b = int(torch.tensor(boundary, dtype=torch.float32).view(torch.int32))
        bits += [b - 1, b, b + 1]
    amax = torch.tensor(bits, dtype=torch.int32).view(torch.float32)
    amax = torch.cat([amax, torch.tensor([float("inf")])])
    head_dim = 16
    key = (amax[:, None] * torch.linspace(-1.0, 1.0, head_dim)).to(dtype)[:, None]  # amax at both ends
    value = key.flip(0)
    shape = (key.shape[0], 1, 1, head_dim + 1)
    k_cache = torch.full(shape, 9, dtype=torch.int8).view(kv_dtype).to(device)
    v_cache = torch.full(shape, 9, dtype=torch.int8).view(kv_dtype).to(device)
    slots = torch.arange(key.shape[0])
    with kernels_only("write_kv"):
        backend.write_kv(key.to(device), value.to(device), k_cache, v_cache, slots.to(device))
    want_k = torch.full(shape, 9, dtype=torch.int8).view(kv_dtype)
    want_v = want_k.clone()
    reference_write_kv(key, value, want_k, want_v, slots)
    got, want = byte_view(k_cache).cpu()[:, 0, 0], byte_view(want_k)[:, 0, 0]
    bad = (got != want).any(-1).nonzero().view(-1).tolist()
    amax_bits = [bits[i] for i in bad if i < len(bits)]
    codes, want_codes = got[bad, -1].view(torch.uint8).tolist(), want[bad, -1].view(torch.uint8).tolist()
    assert not bad, f"{kv_dtype} from {dtype}: rows {bad} (float32 amax bits {amax_bits}): scale codes {codes}, " \
                    f"the reference's {want_codes}"
    assert torch.equal(byte_view(v_cache).cpu(), byte_view(want_v))


@contextlib.contextmanager
def kernels_only(op: str):
    """Make the torch reference's ``op`` (``paged_attention``, ``write_kv``) fail while the block runs, so a
    check of the backend's own kernels cannot pass through a silent fall-back to the reference."""
    from pagedkv.backends.torch_ref import attention as torch_ref_attention

    def fail(*args, **kwargs):
        raise AssertionError(f"the backend fell back to the torch reference's {op}")

    saved = getattr(torch_ref_attention, op)
    setattr(torch_ref_attention, op, fail)
    try:
        yield
    finally:
        setattr(torch_ref_attention, op, saved)


def check_8bit_attention(backend, device, dtype, seq_lens, query_lens, kv_dtype="int8", block_size=16, heads=(8, 2),
                         head_dim=64, window=None, softcap=None, partition=None, seed=5):
    """An 8-bit cache (``kv_dtype``: int8, float8_e4m3fn, float8_e5m2) read by the kernels themselves: the output
    equals a float64 attention over the dequantized rows. Unused slots hold junk values with NaN scales; the
    torch reference's dequantizing gather is made to fail, so a silent fall-back to it cannot pass."""
    import attention_cases

    meta, query, k_cache, v_cache, keys, values = attention_cases.make_case(
        seq_lens, query_lens, block_size, heads=heads[0], kv_heads=heads[1], dim=head_dim, dtype=dtype, seed=seed,
        kv_dtype=getattr(torch, kv_dtype),
    )  # fmt: skip
    scale = 1.0 / math.sqrt(head_dim)
    want, start = [], 0
    for n, q_len, k, v in zip(seq_lens, query_lens, keys, values):
        want.append(attention_cases.reference(query[start : start + q_len], k, v, n - q_len, scale, window, softcap))
        start += q_len

    backend.partition_size = partition
    try:
        with kernels_only("paged_attention"):
            out = backend.attend(query.to(device), k_cache.to(device), v_cache.to(device), meta, scale,
                                 window=window, softcap=softcap)
    finally:
        backend.partition_size = None
    assert_close_to(out, torch.cat(want), dtype, f"{kv_dtype} cache, heads {heads}, head_dim {head_dim}")


def check_8bit_nan_scale(backend, device, dtype, kv_dtype="int8"):
    """The kernels decode scale code 255 as NaN: a read V row with it makes its sequence's output NaN."""
    import attention_cases

    meta, query, k_cache, v_cache = attention_cases.nan_scale_case(getattr(torch, kv_dtype), dtype)
    with kernels_only("paged_attention"):
        out = backend.attend(query.to(device), k_cache.to(device), v_cache.to(device), meta, 0.125)
    attention_cases.assert_nan_scale_read(out.cpu().float())


def check_write_then_attend(backend, device, dtype):
    """The engine's order: write this step's rows through write_kv, then attend over the cache."""
    case = make_case(context_lens=[0, 18, 4], query_lens=[9, 1, 6], dtype=dtype, device=device)
    heads, dim = case.k_cache.shape[2], case.k_cache.shape[3]
    new_k = case.k_cache.view(-1, heads, dim)[case.meta.slot_mapping].clone()
    new_v = case.v_cache.view(-1, heads, dim)[case.meta.slot_mapping].clone()
    case.k_cache.view(-1, heads, dim)[case.meta.slot_mapping] = NAN
    case.v_cache.view(-1, heads, dim)[case.meta.slot_mapping] = NAN
    backend.write_kv(new_k, new_v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = backend.attend(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_close_to(out, naive_attention(case), dtype, "write_kv then attend")


def random_blocks(shape: tuple[int, ...], dtype: torch.dtype, device, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def check_copy_blocks(backend, device, dtype, block_size=16, num_kv_heads=2, head_dim=64, layers=3):
    gen = torch.Generator().manual_seed(3)
    shape = (8, block_size, num_kv_heads, head_dim)
    caches = [
        (random_blocks(shape, dtype, device, gen), random_blocks(shape, dtype, device, gen)) for _ in range(layers)
    ]
    expected = [(k.clone(), v.clone()) for k, v in caches]
    pairs = torch.tensor([[1, 4], [6, 0], [2, 7]], dtype=torch.int64)
    for k, v in expected:
        k[pairs[:, 1]] = k[pairs[:, 0]]
        v[pairs[:, 1]] = v[pairs[:, 0]]
    backend.copy_blocks(caches, pairs.to(device))
    for (k, v), (wk, wv) in zip(caches, expected):
        assert torch.equal(k, wk) and torch.equal(v, wv)
    backend.copy_blocks(caches, torch.empty((0, 2), dtype=torch.int64, device=device))  # no-op


def check_swap_blocks(backend, device, dtype):
    gen = torch.Generator().manual_seed(4)
    shape = (5, 16, 2, 64)
    gpu = [(random_blocks(shape, dtype, device, gen), random_blocks(shape, dtype, device, gen))]
    cpu = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))]
    pairs = torch.tensor([[0, 3], [4, 1]])
    backend.swap_blocks(gpu, cpu, pairs)
    assert torch.equal(cpu[0][0][3], gpu[0][0][0].cpu()) and torch.equal(cpu[0][1][1], gpu[0][1][4].cpu())
    back = [(torch.zeros_like(gpu[0][0]), torch.zeros_like(gpu[0][1]))]
    backend.swap_blocks(cpu, back, torch.tensor([[3, 2]]))
    assert torch.equal(back[0][0][2], gpu[0][0][0])


# ---------------------------------------------------------------------- tests on the GPU


def cupy_backend(dtype: torch.dtype = torch.float16, block_size: int = 16):
    pytest.importorskip("cupy", reason="cupy is not installed (pip install cupy-cuda13x)")
    from pagedkv.backends.cupy.backend import CupyBackend

    return CupyBackend(SimpleNamespace(device="cuda", dtype=dtype, block_size=block_size))


@pytest.fixture(scope="module")
def backend():
    return cupy_backend()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (9, 3), (32, 2)])  # GQA 4, MHA, group 3, group 16 (two tiles)
def test_decode_lengths(backend, dtype, heads):
    check_decode_lengths(backend, "cuda", dtype, heads=heads)


@pytest.mark.parametrize("head_dim", [16, 32, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dims(backend, dtype, head_dim):
    check_decode_lengths(backend, "cuda", dtype, head_dim=head_dim, long=600)
    check_prefill(backend, "cuda", dtype, head_dim=head_dim)


@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 128])  # 16 is specialised, the others use the generic kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_sizes(backend, dtype, block_size):
    check_decode_lengths(backend, "cuda", dtype, block_size=block_size, long=300)
    check_mixed(backend, "cuda", dtype, block_size=block_size, long=300)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (9, 3), (32, 2)])
def test_prefill_and_chunked_prefill(backend, dtype, heads):
    check_prefill(backend, "cuda", dtype, heads=heads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_decode_and_prefill(backend, dtype):
    check_mixed(backend, "cuda", dtype)


@pytest.mark.parametrize("partition_size", [None, 16, 128, 512])
def test_long_context_partitions(backend, partition_size):
    backend.partition_size = partition_size
    try:
        for dtype in DTYPES:
            check_decode_lengths(backend, "cuda", dtype, long=5000)
            check_mixed(backend, "cuda", dtype, long=3000)
    finally:
        backend.partition_size = None


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_8bit_cache_write_and_read(backend, dtype, kv_dtype):
    check_write_kv_8bit(backend, "cuda", dtype, kv_dtype)
    check_write_kv_8bit(backend, "cuda", dtype, kv_dtype, block_size=3, num_kv_heads=1, head_dim=6)


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_write_rounds_to_nearest_even(backend, kv_dtype):
    check_fp8_write_rounding(backend, "cuda", torch.float32, kv_dtype)


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_8bit_scale_code_edges_match_the_reference(backend, dtype, kv_dtype):
    check_8bit_scale_edges(backend, "cuda", dtype, kv_dtype)


EIGHT_BIT = ["int8", "float8_e4m3fn", "float8_e5m2"]


@pytest.mark.parametrize("kv_dtype", EIGHT_BIT)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (9, 3), (32, 2)])
def test_8bit_cache_read_in_the_kernels(backend, kv_dtype, dtype, head_dim, heads):
    # decodes (one long enough for several partitions) and prefill chunks, none a multiple of the block size
    check_8bit_attention(backend, "cuda", dtype, [1, 17, 2100, 40, 95, 3], [1, 1, 1, 40, 30, 2], kv_dtype,
                         heads=heads, head_dim=head_dim)  # fmt: skip


@pytest.mark.parametrize("kv_dtype", EIGHT_BIT)
@pytest.mark.parametrize("dtype", DTYPES)
def test_8bit_nan_scale_code_reads_as_nan(backend, kv_dtype, dtype):
    check_8bit_nan_scale(backend, "cuda", dtype, kv_dtype)


@pytest.mark.parametrize("kv_dtype", EIGHT_BIT)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 7, 16, 32])
def test_8bit_cache_block_sizes_window_softcap(backend, kv_dtype, dtype, block_size):
    lens, q_lens = [5, 50, 300, 33], [1, 1, 1, 20]
    check_8bit_attention(backend, "cuda", dtype, lens, q_lens, kv_dtype, block_size=block_size, heads=(6, 2))
    check_8bit_attention(backend, "cuda", dtype, lens, q_lens, kv_dtype, block_size=block_size, window=30,
                         softcap=3.0, partition=16)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch_reference_backend(backend, dtype):
    check_matches_torch_reference(backend, "cuda", dtype)
    check_matches_torch_reference(backend, "cuda", dtype, heads=(9, 3), head_dim=128, block_size=8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_triton_backend(backend, dtype):
    pytest.importorskip("triton", reason="triton is not installed")
    from pagedkv.backends.triton.backend import TritonBackend

    triton = TritonBackend(SimpleNamespace(device="cuda", dtype=dtype, block_size=16))
    case = make_case(context_lens=[0, 9, 300, 1, 2000], query_lens=[12, 1, 1, 30, 1], dtype=dtype)
    ours = backend.attend(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    theirs = triton.attend(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(ours.double(), theirs.double(), atol=2 * atol, rtol=2 * rtol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_noncontiguous_query(backend, dtype):
    check_noncontiguous_query(backend, "cuda", dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_skips_minus_one(backend, dtype):
    check_write_kv(backend, "cuda", dtype)
    check_write_kv(backend, "cuda", dtype, block_size=5, num_kv_heads=3, head_dim=32)
    check_write_kv(backend, "cuda", dtype, block_size=3, num_kv_heads=1, head_dim=6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_then_attend(backend, dtype):
    check_write_then_attend(backend, "cuda", dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_and_swap_blocks(backend, dtype):
    check_copy_blocks(backend, "cuda", dtype)
    # narrower copy words: blocks of 36 or 6 bytes (fp32: 72, 12), head dims no attention kernel supports
    check_copy_blocks(backend, "cuda", dtype, block_size=3, num_kv_heads=1, head_dim=6)
    check_copy_blocks(backend, "cuda", dtype, block_size=1, num_kv_heads=1, head_dim=3)
    check_swap_blocks(backend, "cuda", dtype)


def test_runs_on_torch_current_stream(backend):
    """Work is queued on torch's current stream: a side stream's result is ready after syncing that stream."""
    case = make_case(context_lens=[100, 0], query_lens=[1, 40], dtype=torch.float16)
    want = naive_attention(case)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = backend.attend(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    side.synchronize()
    assert_close_to(out, want, torch.float16, "side stream")


def test_unsupported_head_dim_is_a_clear_error(backend):
    case = make_case(context_lens=[3], query_lens=[1], head_dim=24, dtype=torch.float16)
    with pytest.raises(ValueError, match="head_dim 24"):
        backend.attend(case.query, case.k_cache, case.v_cache, case.meta, case.scale)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_engine_greedy_matches_transformers(tiny_models, arch):
    """End to end: the engine on the cupy backend gives transformers' greedy tokens (fp32, tiny models)."""
    pytest.importorskip("cupy", reason="cupy is not installed")
    from conftest import hf_greedy, random_prompts
    from pagedkv import LLM, SamplingParams

    prompts = random_prompts([3, 17, 40, 1, 64, 9], seed=1)
    model = copy.deepcopy(tiny_models[arch])  # the engine moves its model to the GPU in place
    want = [hf_greedy(model, p, 16) for p in prompts]
    llm = LLM(hf_model=model, device="cuda", backend="cupy", dtype="float32", block_size=16, num_blocks=256)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in outs] == want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("window", "softcap", "partition"), [(7, None, 16), (None, 2.0, None), (30, 3.0, 16),
                                                              (1, None, None)])
def test_sliding_window_and_softcap(backend, dtype, window, softcap, partition):
    check_window_softcap(backend, "cuda", dtype, window=window, softcap=softcap, partition=partition)
