"""``engine simulate``: the real scheduler, allocator and plugins around a runner that only counts tokens.

An application of the engine, like ``cli``, ``serve`` and ``monitor``: it imports ``pagedkv.core``;
nothing in the core imports it. See docs/simulator.md.
"""
