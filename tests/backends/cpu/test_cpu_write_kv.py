"""The cpu backend's K/V write (one kernel call) against the reference's scatter: same cache bytes, -1 slots
skipped, strided rows (views of the fused layer's qkv buffer), bf16, and a slot past the cache an IndexError."""

from __future__ import annotations

import pytest
import torch

from conftest import cpu_kernel_build
from pagedkv.backends.cpu import build
from pagedkv.backends.cpu.backend import CpuBackend
from pagedkv.backends.torch_ref import TorchBackend


@pytest.fixture(scope="module", params=build.checked_variants())
def backend(request) -> CpuBackend:
    return CpuBackend(cpu_kernel_build(request.param))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_writes_what_the_reference_writes(backend, dtype):
    gen = torch.Generator().manual_seed(0)
    blocks, block, heads, dim, tokens = 6, 4, 3, 8, 9
    qkv = torch.randn(tokens, (5 + 2 * heads) * dim, generator=gen).to(dtype)  # k, v: strided views, as fused
    k = qkv[:, 5 * dim:(5 + heads) * dim].view(tokens, heads, dim)
    v = qkv[:, (5 + heads) * dim:].view(tokens, heads, dim)
    slots = torch.randperm(blocks * block, generator=gen)[:tokens]
    slots[[2, 6]] = -1
    caches = [torch.full((blocks, block, heads, dim), float("nan"), dtype=dtype) for _ in range(4)]
    backend.write_kv(k, v, caches[0], caches[1], slots)
    TorchBackend("cpu").write_kv(k, v, caches[2], caches[3], slots)
    for ours, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(ours.isnan(), ref.isnan())
        assert torch.equal(ours.nan_to_num(7.0), ref.nan_to_num(7.0))
    assert caches[0].isnan().sum() == (blocks * block - (tokens - 2)) * heads * dim  # only the given slots


def test_a_slot_past_the_cache_is_the_references_index_error(backend):
    k = torch.randn(2, 3, 8)
    with pytest.raises(IndexError):  # the kernel refuses the call; the reference it falls back to raises
        backend.write_kv(k, k.clone(), torch.zeros(2, 4, 3, 8), torch.zeros(2, 4, 3, 8), torch.tensor([1, 8]))
