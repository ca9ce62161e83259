"""The engine and what it is made of, one room per concept.

Rooms, lowest first; each imports only from the rooms before it and from the foundation
modules here (``errors``, ``limits``, ``events``, ``stats``, ``config``, ``hookspecs``,
``startup_phases``):

- ``plugin/``: the pluggy manager and the fault guard around plugin calls.
- ``kv/``: the paged KV memory: block pool (free pool, ref counts), block tables, allocators
  (prefix hash, copy-on-write repoints), KV cache sizing, swap space, attention metadata.
- ``sample/``: sampling parameters, the batched sampler, logits processors, logprobs, detokenizer.
- ``sched/``: sequences and their states, the scheduler, request groups (forks), stop checks.
- ``model/``: loading a Hugging Face model offline, checking it is supported, running it on a
  packed batch through our attention function.
- ``dist/``: tensor parallelism: sharding, the process group, the per-step broadcast.

Here at the top: the engine and its public surface (``engine``, ``llm``, ``config``, ``errors``,
``hookspecs``, outputs and stats, telemetry's wire format). Only these modules know every room.
``tests/test_import_graph.py`` checks the order.
"""
