"""Registers the CuPy raw-CUDA backend; cupy itself is imported only when it is chosen."""

from __future__ import annotations

from typing import Any

from pagedkv.core.hookspecs import hookimpl


def _build(config: Any):
    from pagedkv.backends.cupy.backend import CupyBackend

    return CupyBackend(config)


@hookimpl
def pagedkv_register_backends(register: Any) -> None:
    register("cupy", _build, "hand-written CUDA C kernels through CuPy (CUDA only)")
