"""Who runs this step: sequences, their states, and the scheduler that moves them.

``sequence`` (a request's state through the engine and what the user gets back),
``scheduler_interface`` (what the engine calls on a scheduler, the hooks it calls),
``scheduler_output`` (the step a scheduler decides), ``scheduler`` (FCFS continuous batching,
chunked prefill, preemption), ``priority_scheduler``, the ``scheduler_plugin`` registrar,
``grammar_gate`` (constrained requests waiting for their grammar), ``request_groups`` (a
request's samples and forks), ``stop_check`` and ``request_check``. Imports ``kv/``,
``sample/``, ``plugin/`` and the foundation modules.
"""
