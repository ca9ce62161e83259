"""Who runs this step: sequences, their states, and the scheduler that moves them.

``sequence`` (a request's state through the engine and what the user gets back), ``scheduler``
(FCFS continuous batching, chunked prefill, preemption) with its ``scheduler_plugin``
registrar, ``request_groups`` (a request's samples and forks), ``stop_check`` and
``request_check``. Imports ``kv/``, ``sample/``, ``plugin/`` and the foundation modules.
"""
