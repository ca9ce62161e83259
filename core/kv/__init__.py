"""The paged KV memory: blocks, the free pool, block tables and who may write where.

``block_pool`` (physical blocks, ref counts), ``free_block_queue`` (the free blocks in eviction
order, a cached one revived in O(1)), ``block_table`` (a sequence's logical -> physical map),
``allocator_interface`` (what the engine and scheduler call on an allocator, the hooks it calls),
``allocator`` (how tables grow, prefix matches, copy-on-write repoints), the built-in
``allocator_plugin`` registrar, ``kv_cache`` (shape, sizing from a byte budget, allocation),
``kv_dtype`` (the storage dtype and the 8-bit row format: ``docs/kv_format.md``), ``swap_space``
(the CPU swap protocol), ``attention_metadata`` (one per step, read by every layer) and ``kv_view`` (a
read-only view for observers). Imports ``plugin/`` and the foundation modules; knows sequences
only as type hints.
"""
