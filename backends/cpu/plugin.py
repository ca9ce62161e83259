"""Registers the CPU backend; without a working C++ compiler it falls back to the torch reference."""

from __future__ import annotations

import logging
from typing import Any

from pagedkv.core.errors import ConfigError
from pagedkv.core.hookspecs import hookimpl

log = logging.getLogger("pagedkv")


def _build(config: Any):
    from pagedkv.backends.cpu import build

    if str(config.device).startswith("cuda"):
        raise ConfigError("the cpu backend runs on the CPU only; use backend 'torch', 'triton' or 'cupy' on CUDA")
    try:
        lib = build.load()
    except build.BuildError as exc:
        from pagedkv.backends.torch_ref import TorchBackend

        log.warning("pagedkv: CPU attention kernel unavailable (%s); using the torch reference backend", exc)
        return TorchBackend(config.device)
    from pagedkv.backends.cpu.backend import CpuBackend
    from pagedkv.backends.cpu.routes import default_routes

    return CpuBackend(lib, routes=default_routes(lib))


@hookimpl
def pagedkv_register_backends(register: Any) -> None:
    register("cpu", _build, "compiled C++/OpenMP paged attention for the CPU (falls back to torch without g++)")
