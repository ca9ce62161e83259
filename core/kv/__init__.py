"""The paged KV memory: blocks, the free pool, block tables and who may write where.

``block_pool`` (physical blocks, ref counts, the free queue that is also the eviction order),
``block_table`` (a sequence's logical -> physical map), ``allocator`` (how tables grow, prefix
matching by block hash, copy-on-write repoints), the built-in ``allocator_plugin`` registrar,
``kv_cache`` (shape, sizing from a byte budget, allocation), ``swap_space`` (the CPU swap
protocol), ``attention_metadata`` (one per step, read by every layer) and ``kv_view`` (a
read-only view for observers). Imports ``plugin/`` and the foundation modules; knows sequences
only as type hints.
"""
