"""Registers the PyTorch reference backend through the ``pagedkv`` entry-point group."""

from __future__ import annotations

from typing import Any

from pagedkv.core.hookspecs import hookimpl


def _build(config: Any):
    from pagedkv.backends.torch_ref import TorchBackend

    return TorchBackend(config.device)


@hookimpl
def pagedkv_register_backends(register: Any) -> None:
    register("torch", _build, "PyTorch reference (CPU and CUDA)")
