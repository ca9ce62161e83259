"""Suite 4 of issue 7 (CPU part): the torch backend's paged attention against SDPA on contiguous KV.

Run: ``python -m pytest benchmarks/micro/test_kernels_cpu.py --benchmark-only -q -s``. To compare runs side
by side, save them (``--benchmark-save=kernels_cpu``) and use
``pytest-benchmark compare --group-by=group --columns=min,median,rounds`` (each group is one
batch x context x head config, holding the ``torch`` backend and the ``sdpa-contiguous`` baseline).

One decode step of one layer: every sequence has ``ctx`` cached tokens and one query token. The
paged side is ``TorchBackend.attend`` over a block cache whose block tables are a random permutation
of physical blocks (block size 16), with its ``AttentionMetadata`` built once (the step's mask is cached
on it, as it is for the 2nd..Nth layer of a real step). The baseline is
``F.scaled_dot_product_attention(q, k, v, enable_gqa=True)`` over the same K/V laid out contiguously
``[B, Hkv, ctx, D]``, no mask (every sequence is ``ctx`` long). Outputs are checked to agree.

Besides the pytest-benchmark rows, each torch-backend test times the two alternately (pairs, median of
the per-pair ratios), so the printed ratio compares them under the same load at the same moment. The
Triton interpreter is for correctness, not speed, so it is not timed here; GPU numbers come from
``benchmarks/gpu/gpu_suite.py``. Threads: ``PAGEDKV_KERNEL_THREADS`` (default 1; see the README of the
results for why).
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch
import torch.nn.functional as F
from bench_common import facts

from pagedkv.backends.torch_ref import TorchBackend
from pagedkv.backends.torch_ref.attention import gather_kv
from pagedkv.core.kv.attention_metadata import AttentionMetadata

THREADS = int(os.environ.get("PAGEDKV_KERNEL_THREADS", "1"))
THREAD_NOTE = f"{THREADS} torch thread(s)"  # printed beside every result
BLOCK = 16
HEADS = {"smollm2-9q3kv-d64": (9, 3, 64), "llama-32q8kv-d128": (32, 8, 128)}
CONFIGS = [
    (heads, batch, ctx)
    for heads in HEADS
    for batch in (1, 16, 64)
    for ctx in (256, 2048)
    if not (heads.startswith("llama") and batch == 64 and ctx == 2048)  # 1 GiB of KV per layer: too slow here
]
_ratios: dict[tuple, dict] = {}



@pytest.fixture(autouse=True)
def _threads():
    old = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(old)


class Case:
    """The same K/V tokens, paged (shuffled blocks) and contiguous."""

    def __init__(self, heads: str, batch: int, ctx: int, seed: int = 0) -> None:
        num_heads, num_kv, dim = HEADS[heads]
        g = torch.Generator().manual_seed(seed)
        self.scale = dim**-0.5
        self.q = torch.randn(batch, num_heads, dim, generator=g)
        self.k = torch.randn(batch, num_kv, ctx, dim, generator=g)
        self.v = torch.randn(batch, num_kv, ctx, dim, generator=g)
        per_seq = -(-ctx // BLOCK)
        num_blocks = batch * per_seq + 1
        perm = torch.randperm(num_blocks, generator=g).tolist()
        tables = [perm[i * per_seq:(i + 1) * per_seq] for i in range(batch)]
        self.k_cache = torch.zeros(num_blocks, BLOCK, num_kv, dim)
        self.v_cache = torch.zeros(num_blocks, BLOCK, num_kv, dim)
        for i, table in enumerate(tables):
            for j, block in enumerate(table):
                rows = slice(j * BLOCK, min(ctx, (j + 1) * BLOCK))
                n = rows.stop - rows.start
                self.k_cache[block, :n] = self.k[i, :, rows].transpose(0, 1)
                self.v_cache[block, :n] = self.v[i, :, rows].transpose(0, 1)
        self.meta = AttentionMetadata.build(
            block_tables=tables, context_lens=[ctx - 1] * batch, query_lens=[1] * batch, block_size=BLOCK
        )
        self.backend = TorchBackend("cpu")

    def paged(self) -> torch.Tensor:
        return self.backend.attend(self.q, self.k_cache, self.v_cache, self.meta, self.scale)

    def contiguous(self) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            self.q[:, :, None], self.k, self.v, scale=self.scale, enable_gqa=self.q.shape[1] != self.k.shape[1]
        )
        return out[:, :, 0]

    def gather_only(self) -> None:
        m = self.meta
        gather_kv(self.k_cache, m.block_tables, m.seq_lens, m.max_seq_len, min(m.seq_lens_cpu))
        gather_kv(self.v_cache, m.block_tables, m.seq_lens, m.max_seq_len, min(m.seq_lens_cpu))


_cases: dict[tuple, Case] = {}


def case(heads: str, batch: int, ctx: int) -> Case:
    key = (heads, batch, ctx)
    if key not in _cases:
        _cases.clear()  # keep one config's tensors alive at a time
        _cases[key] = Case(heads, batch, ctx)
    return _cases[key]


def _rounds(fn, budget_s: float = 0.6) -> int:
    t = time.perf_counter()
    fn()
    one = time.perf_counter() - t
    return max(3, min(200, int(budget_s / max(one, 1e-6))))


def _interleaved(a, b, pairs: int) -> list[float]:
    ratios = []
    for _ in range(pairs):
        t0 = time.perf_counter()
        a()
        t1 = time.perf_counter()
        b()
        t2 = time.perf_counter()
        ratios.append((t1 - t0) / (t2 - t1))
    return ratios


@pytest.mark.parametrize("backend", ["torch", "sdpa-contiguous"])
@pytest.mark.parametrize("heads,batch,ctx", CONFIGS)
def test_decode_attention(benchmark, heads, batch, ctx, backend):
    benchmark.group = f"attention decode cpu: {heads} B={batch} ctx={ctx}"
    c = case(heads, batch, ctx)
    fn = c.paged if backend == "torch" else c.contiguous
    if backend == "torch":
        torch.testing.assert_close(c.paged(), c.contiguous(), rtol=1e-4, atol=1e-4)
    benchmark.extra_info.update(heads=heads, batch=batch, ctx=ctx, threads=THREADS, loadavg=os.getloadavg())
    benchmark.pedantic(fn, rounds=_rounds(fn), iterations=1, warmup_rounds=1)
    if backend == "torch":
        pairs = max(3, min(30, _rounds(c.paged, 0.3)))
        ratio = statistics.median(_interleaved(c.paged, c.contiguous, pairs))
        gather = statistics.median(_interleaved(c.gather_only, c.contiguous, pairs))
        kv_bytes = 2 * c.k.numel() * 4
        _ratios[heads, batch, ctx] = {"paged_over_sdpa": ratio, "gather_over_sdpa": gather, "pairs": pairs,
                                      "kv_mib": kv_bytes / 2**20, "load1": os.getloadavg()[0]}
        benchmark.extra_info.update(paged_over_sdpa_interleaved=round(ratio, 3),
                                    gather_over_sdpa_interleaved=round(gather, 3))
        print(f"\n[kernels] {heads} B={batch} ctx={ctx}: torch paged / SDPA contiguous = {ratio:.2f}x "
              f"(gather of K and V alone = {gather:.2f}x SDPA; {pairs} interleaved pairs; KV {kv_bytes / 2**20:.1f} "
              f"MiB); {facts(THREAD_NOTE)}")


def test_kernels_summary(benchmark):
    """The interleaved ratios of every config (printed once; timed: nothing)."""
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    if not _ratios:
        pytest.skip("no kernel rows")
    print(f"\n[kernels summary] decode, one layer, block size {BLOCK}, fp32; {facts(THREAD_NOTE)}")
    print(f"  {'heads':<20} {'batch':>5} {'ctx':>5} {'KV MiB':>7} {'paged/sdpa':>10} {'gather/sdpa':>11} {'load1':>5}")
    for (heads, batch, ctx), r in _ratios.items():
        print(f"  {heads:<20} {batch:>5} {ctx:>5} {r['kv_mib']:>7.1f} {r['paged_over_sdpa']:>10.2f} "
              f"{r['gather_over_sdpa']:>11.2f} {r['load1']:>5.2f}")
