"""CPU checks of the CuPy backend: without a usable CUDA device it refuses at once, with a clear message."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from pagedkv.backends.cupy.backend import NEEDS_CUDA, CupyBackend, _DecodeShape

MESSAGE = "the cupy backend needs a CUDA device; use --backend torch"


def config(device: str = "cuda", dtype: torch.dtype = torch.float16, block_size: int = 16) -> SimpleNamespace:
    return SimpleNamespace(device=device, dtype=dtype, block_size=block_size)


def test_message_is_the_documented_one() -> None:
    assert NEEDS_CUDA == MESSAGE


def test_cpu_device_is_refused() -> None:
    with pytest.raises(RuntimeError, match="needs a CUDA device; use --backend torch") as info:
        CupyBackend(config(device="cpu"))
    assert "'cpu'" in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_cuda_device_without_gpu_is_refused() -> None:
    with pytest.raises(RuntimeError, match="needs a CUDA device; use --backend torch"):
        CupyBackend(config(device="cuda"))


def test_missing_cupy_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    with pytest.raises(RuntimeError, match="needs a CUDA device; use --backend torch") as info:
        CupyBackend(config(device="cuda"))
    assert "cupy is not installed" in str(info.value)


def test_cupy_without_driver_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch may claim a device that CuPy's runtime cannot use (e.g. driver too old): still a clean refusal."""

    class NoDriver(Exception):
        pass

    def device_count() -> int:
        raise NoDriver("cudaErrorInsufficientDriver")

    fake = SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(getDeviceCount=device_count)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    with pytest.raises(RuntimeError, match="needs a CUDA device; use --backend torch") as info:
        CupyBackend(config(device="cuda"))
    assert "cudaErrorInsufficientDriver" in str(info.value)


def test_plugin_builder_refuses_the_same_way() -> None:
    from pagedkv.backends.cupy import plugin

    with pytest.raises(RuntimeError, match="needs a CUDA device; use --backend torch"):
        plugin._build(config(device="cpu"))


@pytest.mark.parametrize(
    ("elem_size", "head_dim", "tpr", "elems", "groups"),
    [
        (2, 128, 16, 8, 8),
        (4, 128, 32, 4, 4),
        (4, 256, 32, 8, 4),
        (2, 80, 16, 8, 8),
        (4, 16, 4, 4, 32),
        (2, 16, 2, 8, 64),
    ],
)
def test_decode_launch_shape_mirrors_the_kernel(elem_size: int, head_dim: int, tpr: int, elems: int, groups: int):
    shape = _DecodeShape.of(elem_size, head_dim)
    assert (shape.tpr, shape.elems, shape.groups) == (tpr, elems, groups)
    # Dynamic shared memory stays under the 48 KiB that needs no opt-in, for the largest tile and partition.
    assert shape.shared_bytes(8, 512) <= 48 * 1024


@pytest.mark.parametrize("elem_size", [4, 2])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("head_tile", [1, 2, 4, 8])
@pytest.mark.parametrize("requested", [16, 512, 1000, 4096, 1 << 20])
def test_decode_partition_keeps_shared_memory_within_48_kib(elem_size, head_dim, head_tile, requested) -> None:
    from pagedkv.backends.cupy.backend import SHARED_LIMIT, decode_partition

    shape = _DecodeShape.of(elem_size, head_dim)
    partition = decode_partition(requested, shape, head_tile)
    assert 1 <= partition <= requested
    assert shape.shared_bytes(head_tile, partition) <= SHARED_LIMIT == 48 * 1024
    if partition < requested:  # cut only as far as needed: one more token would not fit
        assert shape.shared_bytes(head_tile, partition + 1) > SHARED_LIMIT
    if requested <= 512:  # the default partitions are never cut
        assert partition == requested
