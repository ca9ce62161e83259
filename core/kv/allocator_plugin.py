"""Registers the built-in allocators through the ``pagedkv`` entry-point group."""

from __future__ import annotations

from pagedkv.core.hookspecs import hookimpl
from pagedkv.core.kv.allocator import PagedAllocator, StaticAllocator
from pagedkv.core.plugin.plugin_manager import Register


@hookimpl
def pagedkv_register_allocators(register: Register) -> None:
    register("paged", PagedAllocator, "PagedAttention: grow one block at a time")
    register("static", StaticAllocator, "baseline: reserve max_model_len slots per request up front")
