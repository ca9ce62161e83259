"""The pluggy hook specifications: the contract between the core and plugins.

Registrar hooks run once at engine start-up and fill typed registries; the hot
path then calls plain methods on the chosen objects. A plugin acts on the core
only through these hooks, the arguments they pass and the typed protocols they
name (:class:`~pagedkv.core.kv.swap_space.SwapSpace`, :class:`~pagedkv.core.kv.kv_view.KVCacheView`,
:class:`~pagedkv.core.kv.allocator_interface.Allocator`, :class:`~pagedkv.core.sched.scheduler_interface.Scheduler`);
it never sets a core object's attribute. Which decision and observer
hooks an engine calls is decided when it is built, so register plugins before
(``Engine(plugins=...)``, entry points, or ``pagedkv_configure``), not after. Decision hooks
(``firstresult=True``) pick one answer; observer hooks are broadcast, batched
per step. No hook is called per layer or per token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # type hints only: the contract names the core's types, and imports none of them
    from pagedkv.core.config import EngineConfig
    from pagedkv.core.engine import Engine
    from pagedkv.core.events import Event
    from pagedkv.core.kv.allocator_interface import Allocator
    from pagedkv.core.kv.kv_cache import KVCacheSpec
    from pagedkv.core.kv.swap_space import SwapSpace
    from pagedkv.core.plugin.plugin_manager import Register
    from pagedkv.core.sample.sampling_params import SamplingParams
    from pagedkv.core.sched.scheduler_interface import Scheduler
    from pagedkv.core.sched.sequence import Sequence

PROJECT = "pagedkv"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --- registrars (called once, when the engine builds its registries) ---------------------------


@hookspec
def pagedkv_register_backends(register: Register) -> None:
    """Register attention backends.

    Call ``register(name, factory, description)``; ``factory(config)`` returns an
    object implementing :class:`pagedkv.backends.base.AttentionBackend`. Import
    heavy frameworks inside ``factory``, never at module import.
    """


@hookspec
def pagedkv_register_allocators(register: Register) -> None:
    """Register block allocators: ``register(name, factory, description)``; ``factory(pool, block_size, hooks)``
    (an :class:`~pagedkv.core.kv.allocator_interface.AllocatorFactory`) returns an
    :class:`~pagedkv.core.kv.allocator_interface.Allocator`; ``hooks`` is an ``AllocatorHooks`` (the plugin
    decisions it may ask) or None when no plugin makes any."""


@hookspec
def pagedkv_register_schedulers(register: Register) -> None:
    """Register schedulers: ``register(name, factory, description)``;
    ``factory(config, allocator, events, hooks, stop_check=..., swap_space=...)`` (a
    :class:`~pagedkv.core.sched.scheduler_interface.SchedulerFactory`) returns a
    :class:`~pagedkv.core.sched.scheduler_interface.Scheduler`; ``hooks`` is a ``SchedulerHooks`` (what it
    calls outside itself), ``stop_check`` the engine's end-of-sequence rule and ``swap_space`` the engine's
    :class:`~pagedkv.core.kv.swap_space.SwapSpace` or None."""


@hookspec
def pagedkv_register_grammar_backends(register: Register) -> None:
    """Register grammar backends for structured outputs: ``register(name, factory, description)``;
    ``factory(tokenizer, vocab_size, eos_token_ids)`` returns a
    :class:`~pagedkv.core.sample.grammar_backend.GrammarBackend` (called once, on the compile thread, when the
    first constrained request arrives: import heavy packages there).
    ``EngineConfig.structured_outputs_backend`` names the one an engine uses (``"guidance"``, built in)."""


@hookspec
def pagedkv_register_tool_parsers(register: Register) -> None:
    """Register tool-call parsers for ``engine serve --tool-call-parser NAME``: ``register(name, factory,
    description)``; ``factory()`` returns a parser for one answer whose ``feed(text)`` (each step's new text)
    and ``finish()`` return content strings and :class:`~pagedkv.serve.tool_parsers.base.Candidate` calls
    (the older whole-text ``parse(text, final)`` giving ``Parsed`` is still read, once, at the end)."""


@hookspec
def pagedkv_register_reasoning_parsers(register: Register) -> None:
    """Register reasoning parsers for ``engine serve --reasoning-parser NAME``: ``register(name, factory,
    description)``; ``factory()`` returns a parser for one answer whose ``feed(text)`` / ``finish()`` give
    (reasoning, content), with ``start`` / ``end`` marker texts (or the older ``split(text, final)``)."""


# --- lifecycle -----------------------------------------------------------------------------------


@hookspec
def pagedkv_configure(config: EngineConfig, pm: pluggy.PluginManager) -> None:
    """The engine is being built from ``config``; plugins are known but nothing is allocated yet.

    A plugin that keeps per-engine state registers a fresh object here,
    ``pm.register(MyState(config))``, when ``config`` switches it on (for example
    ``config.enable_prefix_caching``). Module-level plugins are shared by every
    engine in the process, so they must not keep state themselves.
    """


@hookspec(firstresult=True)
def pagedkv_swap_space(config: EngineConfig, spec: KVCacheSpec) -> SwapSpace | None:
    """Offer a place for preempted sequences' KV blocks: return a :class:`~pagedkv.core.kv.swap_space.SwapSpace`
    (or None). ``spec`` is the :class:`~pagedkv.core.kv.kv_cache.KVCacheSpec`. The scheduler then calls it
    when a preemption is answered ``"swap"``, and a real model runner asks it for its host caches."""


@hookspec
def pagedkv_engine_started(engine: Engine) -> None:
    """The engine is built (pool, allocator, scheduler, model runner); plugins may keep a reference
    and read it through public, read-only views (``engine.kv_view()``, ``engine.stats``, ``engine.config``)."""


# --- decision points (first non-None answer wins) ----------------------------------------------


@hookspec(firstresult=True)
def pagedkv_match_prefix(seq: Sequence, allocator: Allocator) -> list[int] | None:
    """A new request starts: return physical block ids already holding its first full blocks.

    The core takes a reference on each returned block and skips computing their
    tokens. The match must leave at least one prompt token to compute.
    """


@hookspec(firstresult=True)
def pagedkv_fork_after_prefill(params: SamplingParams) -> bool | None:
    """A request asks for ``params.n > 1`` samples: return True to prefill the prompt once and
    fork the samples after prefill, sharing its blocks (the default runs n independent sequences)."""


@hookspec(firstresult=True)
def pagedkv_copy_on_write(seq: Sequence, logical_index: int, allocator: Allocator) -> bool | None:
    """``seq`` is about to write into block ``logical_index``, which other sequences share.

    Give it a private copy with ``allocator.replace_block(seq, logical_index)`` (a new block in
    the table, the old reference dropped, the copy run on the backend before this step's
    forward) and return True. Without an answer the write is refused (the request fails).
    """


@hookspec(firstresult=True)
def pagedkv_choose_preemption(seq: Sequence, scheduler: Scheduler) -> str | None:
    """The scheduler must preempt ``seq``: answer ``"swap"`` or ``"recompute"`` (the default).

    ``"swap"`` is honoured only when the engine has a swap space (``pagedkv_swap_space``)
    and it has room for the sequence's blocks.
    """


@hookspec(firstresult=True)
def pagedkv_on_block_released(block_id: int) -> bool | None:
    """A block's ref count reached 0: return True if its content stays reusable (cached).

    A cached block waits in the pool's free queue behind every plain free block until it is
    shared again (``pool.incref``, e.g. from ``pagedkv_match_prefix``) or evicted
    (``pagedkv_on_block_evicted``). A plugin that raises here is disabled; the block is freed.
    """


@hookspec
def pagedkv_on_block_evicted(block_id: int) -> None:
    """A cached block is being handed out for new content: forget what it held.
    A plugin that raises here is disabled; the block is handed out all the same."""


# --- observers (broadcast) -----------------------------------------------------------------------


@hookspec
def pagedkv_on_block_full(seq: Sequence, logical_index: int, block_id: int) -> None:
    """A sequence's block ``logical_index`` (physical ``block_id``) now holds ``block_size`` computed tokens."""


@hookspec
def pagedkv_report_stats() -> dict[str, Any]:
    """Counters for the run summary (e.g. ``{"prefix_hit_rate": 0.4}``); every answer is merged."""


@hookspec
def pagedkv_on_step_events(events: list[Event]) -> None:
    """The telemetry events of one step (block and request state changes), in order."""
