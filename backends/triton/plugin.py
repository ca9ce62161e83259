"""Registers the Triton backend; triton itself is imported only when it is chosen."""

from __future__ import annotations

from typing import Any

from pagedkv.core.hookspecs import hookimpl


def _build(config: Any):
    from pagedkv.backends.triton.backend import TritonBackend

    return TritonBackend(config)


@hookimpl
def pagedkv_register_backends(register: Any) -> None:
    register("triton", _build, "Triton kernels (CUDA, or CPU through the Triton interpreter)")
