"""The engine: add requests, step, abort. Wires the pool, allocator, scheduler, runner and plugins.

One step is a straight line, as in vLLM and nano-vllm: the scheduler decides the step,
the runner computes it, the sampler draws tokens, and the scheduler's
``update_from_output`` does the bookkeeping (counters, full blocks, finishes); the
engine then reports outputs and events.

A step is transactional per request: whatever fails for one request after the model ran
(its sampling, its prompt logprobs, its stop check, building its output) ends that request
alone with finish reason ``"error"``, and every other request's state is what it would be
without the failure. A failing forward pass is not one request's: ``step`` raises, with no
counter advanced (see :meth:`Engine.step`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from pagedkv.core.config import EngineConfig
from pagedkv.core.dtype_choice import choose_dtype, features_of
from pagedkv.core.engine_checks import size_kv_cache, start_backend
from pagedkv.core.errors import RequestRejected
from pagedkv.core.events import EventLog
from pagedkv.core.invariants import check_invariants
from pagedkv.core.kv.allocator_interface import Allocator, AllocatorFactory, AllocatorHooks
from pagedkv.core.kv.block_pool import BlockPool
from pagedkv.core.kv.kv_cache import capacity_line
from pagedkv.core.kv.kv_view import KVCacheView
from pagedkv.core.kv.swap_space import SwapSpace
from pagedkv.core.output_processor import OutputProcessor
from pagedkv.core.plugin.plugin_guard import (
    Decision,
    Observers,
    PluginFault,
    PoolHook,
    call_startup,
    configure_plugins,
    startup_fault,
)
from pagedkv.core.plugin.plugin_manager import Entry, build_registry, chosen_components, has_impls, make_plugin_manager
from pagedkv.core.prompt_inputs import prompt_of
from pagedkv.core.runner import Runner, make_runner
from pagedkv.core.sample.bad_words import bad_word_ids
from pagedkv.core.sample.grammar_backend import CompiledGrammar, GrammarBackend
from pagedkv.core.sample.grammar_compiler import GrammarCompiler, result_of
from pagedkv.core.sample.mask_ahead import MaskAhead
from pagedkv.core.sample.sampler import Sampler
from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.core.sample.structured_output import StructuredOutputs
from pagedkv.core.sched.grammar_gate import IDLE_WAIT_S, GrammarGate
from pagedkv.core.sched.request_check import check_priority, check_prompt, check_text
from pagedkv.core.sched.request_groups import RequestGroups
from pagedkv.core.sched.scheduler_interface import Scheduler, SchedulerFactory, SchedulerHooks
from pagedkv.core.sched.scheduler_output import Sample, SchedulerOutput
from pagedkv.core.sched.sequence import RequestOutput, Sequence
from pagedkv.core.sched.stop_check import StopCheck, eos_token_ids_of
from pagedkv.core.startup_phases import phase
from pagedkv.core.stats import RunStats, tokens_held
from pagedkv.core.step_sampling import StepSampling, sampling_rows

log = logging.getLogger("pagedkv")


def _auto_dtype(config: EngineConfig, model: torch.nn.Module | None, runner: Runner | None,
                backend: object) -> torch.dtype:
    """``--dtype auto`` decided from the checkpoint's dtype and the backend's features (one log line says why)."""
    if model is not None:
        checkpoint = getattr(model, "dtype", None)
    elif runner is not None:
        checkpoint = getattr(runner.model_config, "torch_dtype", None)
    else:
        from pagedkv.core.model.model_loader import checkpoint_dtype

        checkpoint = checkpoint_dtype(config.model, config.revision, config.quantization)
    choice = choose_dtype(checkpoint, config.device, features_of(backend), config.quantization)
    log.info(choice.log_line())
    return choice.dtype


class Engine:
    """Streaming inference over a paged KV cache.

    ``model``/``tokenizer`` may be given already loaded (tests build tiny ones); otherwise
    ``config.model`` is loaded offline. With ``runner`` (a :class:`~pagedkv.core.runner.Runner`)
    no model is loaded: its ``model_config`` sizes the cache and it computes each step.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        model: torch.nn.Module | None = None,
        tokenizer: Any = None,
        plugins: tuple[object, ...] = (),
        runner: Runner | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        with phase("plugins loaded"):
            self.pm = make_plugin_manager(plugins)
            configure_plugins(self.pm, config)  # (start-up hooks contain a failing plugin: see plugin_guard)
            backend_entry, allocator_entry, scheduler_entry = chosen_components(self.pm, config, startup_fault)
        self.backend = None
        from_config = model is None
        if runner is None:
            with phase(f"backend {config.backend!r} started"):
                self.backend = start_backend(backend_entry, config)  # a backend that cannot run fails before loading
        if config.dtype == "auto":  # vLLM's default: decided from the backend's features, before loading or sizing
            config.dtype = _auto_dtype(config, model, runner, self.backend)
        if runner is None:
            from pagedkv.core.model.model_loader import prepare_model

            model, tokenizer = prepare_model(config, model, tokenizer)
        hf_config = runner.model_config if runner is not None else model.config
        self.model, self.tokenizer = model, tokenizer
        self.vocab_size = getattr(hf_config, "vocab_size", None) or 2**31
        self.spec, self.num_blocks, self.max_model_len = size_kv_cache(config, hf_config, model, runner is None)
        self.capacity_tokens = self.num_blocks * config.block_size
        self.stats = RunStats()
        self._build_memory(allocator_entry.factory)
        self.stop_check = StopCheck(eos_token_ids_of(model, tokenizer), tokenizer)
        self.scheduler = self._build_scheduler(self._scheduler_factory(scheduler_entry))
        if runner is None:
            with phase("model runner built"):
                runner = make_runner(config, model, self.backend, self.spec, self.num_blocks, self.swap_space,
                                     from_config)
        self.runner = runner
        self._build_step_parts(clock)
        call_startup(self.pm, "pagedkv_engine_started", engine=self)

    eos_token_ids = property(lambda self: self.stop_check.eos_token_ids,
                             lambda self, ids: setattr(self.stop_check, "eos_token_ids", frozenset(ids)),
                             doc="The model's end-of-sequence ids (kept by the stop check).")

    def _build_memory(self, allocator_factory: AllocatorFactory) -> None:
        """The block pool, the allocator over it and the swap space (a plugin's, or None), each with the
        plugin hooks it calls; a hook no plugin implements is not passed at all (it costs nothing)."""
        pm = self.pm
        self.events = EventLog(enabled=has_impls(pm, "pagedkv_on_step_events"))
        on_release = PoolHook(pm, "pagedkv_on_block_released", firstresult=True) or None
        on_evict = PoolHook(pm, "pagedkv_on_block_evicted", firstresult=False) or None
        self.pool = BlockPool(self.num_blocks, self.events, on_release=on_release, on_evict=on_evict)
        match_prefix = Decision(pm, "pagedkv_match_prefix") or None
        copy_on_write = Decision(pm, "pagedkv_copy_on_write") or None
        sharing = match_prefix is not None or copy_on_write is not None
        hooks = AllocatorHooks(match_prefix, copy_on_write) if sharing else None
        self.allocator: Allocator = allocator_factory(self.pool, self.config.block_size, hooks)
        self._sharing = sharing
        self._fork_hook = Decision(pm, "pagedkv_fork_after_prefill") or None
        self.swap_space: SwapSpace | None = call_startup(pm, "pagedkv_swap_space", firstresult=True,
                                                         config=self.config, spec=self.spec)

    def _scheduler_factory(self, entry: Entry) -> SchedulerFactory:
        """The registered scheduler's factory (the simulator's engine puts an equivalent, faster one here)."""
        return entry.factory

    def _build_scheduler(self, factory: SchedulerFactory) -> Scheduler:
        """The scheduler, whole: limits, allocator, events, the hooks it calls, the stop rule, the swap space."""
        hooks = SchedulerHooks(
            choose_preemption=Decision(self.pm, "pagedkv_choose_preemption") or None,
            on_block_full=Observers(self.pm, "pagedkv_on_block_full") or None,
            on_step_peak=self._observe_peak,
        )
        return factory(self.config, self.allocator, self.events, hooks, stop_check=self.stop_check,
                       swap_space=self.swap_space)

    def _build_step_parts(self, clock: Callable[[], float] | None) -> None:
        """What a step runs through after the model: sampling, request groups, grammars, outputs."""
        self._step_observers = Observers(self.pm, "pagedkv_on_step_events")
        self.sampler = Sampler(self.config.seed)
        self.clock = clock or time.monotonic  # what telemetry stamps: wall time, or a simulator's simulated seconds
        self.requests = RequestGroups(self.sampler, self.max_model_len, self.stats, self.events)
        self.grammars = self._make_grammar_compiler()
        self.masks = MaskAhead(lambda: self.grammars.backend, self.vocab_size)  # slow grammars' masks, off the loop
        self.grammar_gate = GrammarGate(self.masks)
        self.sampling = StepSampling(self.sampler, self.stop_check, self.requests.keys, self.grammars, self.masks)
        self.outputs = OutputProcessor(self.requests, self.scheduler, self.stats, self.tokenizer)
        self._ids = itertools.count()  # request ids 0, 1, 2, ...

    def _make_grammar_compiler(self) -> GrammarCompiler:
        """The compiler of constrained requests' grammars; its backend is built on first use, off this thread."""
        entry = build_registry(self.pm, "grammar backend", "pagedkv_register_grammar_backends", startup_fault).get(
            self.config.structured_outputs_backend)
        tokenizer, vocab_size = self.tokenizer, self.vocab_size

        def make_backend() -> GrammarBackend:
            if tokenizer is None:
                raise RequestRejected("structured outputs need the model's tokenizer")
            return entry.factory(tokenizer, vocab_size, self.stop_check.eos_token_ids)

        c = self.config
        return GrammarCompiler(make_backend, cache_bytes=c.grammar_cache_bytes, workers=c.grammar_compile_workers,
                               timeout_s=c.grammar_compile_timeout, max_bytes=c.max_grammar_bytes)

    def _any_impl(self, *hook_names: str) -> bool:
        return any(has_impls(self.pm, name) for name in hook_names)

    def capacity_line(self) -> str:
        """The KV budget in plain words: how many requests of the longest allowed length fit at once, and the
        bytes the weights hold (quantized blocks count as their bytes: what a byte budget has left for KV)."""
        line = capacity_line(self.num_blocks, self.spec, self.max_model_len, self.config.tensor_parallel_size,
                             self.config.kv_cache_dtype)
        if isinstance(self.model, torch.nn.Module):  # (a simulator's engine has no model)
            from pagedkv.core.model.quant_linear import weights_text

            line += f"; {weights_text(self.model)}"
        return line

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at exit); a tensor-parallel engine cannot step after."""
        self.grammars.close()
        self.masks.close()
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- requests -------------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int] | dict,
                      truncate: int | None = None) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt; raises :class:`RequestRejected` if it can never run here.

        ``prompt`` is text, token ids, or vLLM's ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``;
        ``truncate`` keeps only the last ``truncate`` tokens (-1: the model's length), as vLLM's
        ``truncate_prompt_tokens``.
        """
        prompt = prompt_of(prompt)
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, list(prompt))
        if text is not None:
            if self.tokenizer is None:
                raise RequestRejected("a text prompt needs a tokenizer; pass token ids instead")
            check_text(text, "the prompt")
            ids = list(self.tokenizer(text)["input_ids"])
        if truncate is not None:
            keep = self.max_model_len if truncate == -1 else truncate
            ids = ids[-keep:]
        check_prompt(ids, self.vocab_size, self.max_model_len, self.num_blocks, self.config.block_size)
        return text, ids

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a request; raises :class:`RequestRejected` (and changes nothing) if it can never run.

        ``priority`` (lower runs first, as vLLM) needs a scheduler that honours it (``scheduler="priority"``);
        any other scheduler refuses a non-zero one rather than ignore it.
        """
        # a re-checked private copy: the caller's later edits to ``params`` cannot reach a step
        params = params.checked_copy() if params is not None else SamplingParams()
        self.check_priority(priority)
        text, token_ids = self.encode_prompt(prompt, params.truncate_prompt_tokens)
        params.check_vocab(self.vocab_size)
        if params.bad_words:
            params.bad_words_token_ids = [*params.bad_words_token_ids, *bad_word_ids(self.tokenizer, params.bad_words)]
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        grammar = self._submit_grammar(params)
        first_key = self.requests.reserve_keys(params.n)  # before any plugin runs (see request_groups)
        try:
            fork = params.n > 1 and self._fork_hook is not None and bool(self._fork_hook(params=params))
        except PluginFault as fault:
            raise RequestRejected(str(fault)) from fault
        seqs = self.requests.add(request_id, token_ids, params, first_key, fork=fork, prompt=text,
                                 cache_salt=cache_salt)
        for seq in seqs:
            seq.priority = priority
        if grammar is not None:
            self.grammar_gate.park(request_id, grammar, seqs)  # joins the scheduler once compiled
        else:
            for seq in seqs:
                self.scheduler.add(seq)
        self.stats.requests += 1
        self.stats.prompt_tokens += len(token_ids) * params.n
        self.events.emit("request_add", request=request_id, prompt_tokens=len(token_ids), n=params.n)
        return request_id

    def check_priority(self, priority: object) -> int:
        """``priority`` if this engine can take it: a signed 64-bit integer, non-zero only under a scheduler
        that honours it; :class:`RequestRejected` naming ``priority`` otherwise."""
        check_priority(priority)
        if priority and not self.scheduler.uses_priority:
            raise RequestRejected(f"priority {priority} needs priority scheduling (scheduler 'priority', "
                                  f"--scheduling-policy priority); this engine runs {self.config.scheduler!r}")
        return priority

    def _submit_grammar(self, params: SamplingParams) -> Future[CompiledGrammar] | None:
        """The compile future of a constrained request (None if unconstrained); one already failed is refused."""
        if params.structured is None:
            return None
        if self.tokenizer is None:
            raise RequestRejected("structured outputs need the model's tokenizer")
        future = self.grammars.submit(params.structured)
        if future.done():
            result_of(future)  # raises RequestRejected with the reason
        return future

    def submit_structured(self, constraint: StructuredOutputs, client: str = "") -> Future[CompiledGrammar]:
        """The compile of ``constraint`` (done at once when cached or refused for its size), for a caller that
        awaits it without holding a thread; :func:`~pagedkv.core.sample.grammar_compiler.result_of` reads it."""
        if self.tokenizer is None:
            raise RequestRejected("structured outputs need the model's tokenizer")
        return self.grammars.submit(constraint, client)

    def check_structured(self, constraint: StructuredOutputs, client: str = "") -> None:
        """Compile ``constraint`` now (blocking; not for the step loop's thread): raises :class:`RequestRejected`
        saying why if it cannot be. A later request with an equal constraint reuses the compiled grammar.
        ``client`` (the server gives the peer's address) gets fair turns on the compile workers."""
        if self.tokenizer is None:
            raise RequestRejected("structured outputs need the model's tokenizer")
        self.grammars.check(constraint, client)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks go back to the pool. False if unknown."""
        seqs = self.requests.pop(request_id)
        if seqs is None:
            return False
        self.grammar_gate.discard(request_id)
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        return True

    def evictable(self, priority: int) -> list[tuple[str, int]]:
        """Requests a newcomer of ``priority`` may push out of a full waiting queue, the first to go first, as
        (request id, its sequences): those the scheduler names (under the priority scheduler, a strictly
        worse priority) whose every sample is still waiting and never ran, so none has answered anything.
        End one with :meth:`abort` (its blocks go back like any abort)."""
        candidates = self.scheduler.eviction_candidates(priority)
        waiting = {seq.seq_id for seq in candidates}
        found: dict[str, int] = {}
        for seq in candidates:
            rid = seq.request_id
            if rid not in found and rid in self.requests and all(s.seq_id in waiting for s in self.requests[rid]):
                found[rid] = len(self.requests[rid])
        return list(found.items())

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.grammar_gate)

    # --- the step -----------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, stream: bool = True) -> list[RequestOutput]:
        """Run one engine step. Returns outputs of requests that finished (and, if
        ``stream``, of those that produced a token).

        If the model's forward pass raises, so does ``step``: no sequence's counters moved, so a later
        step recomputes the same tokens (the step's swaps and copy-on-write copies ran before the forward
        pass; if those raise, the device's KV cache cannot be trusted and the engine should be dropped).
        """
        return self._step(stream)

    def _step(self, stream: bool) -> list[RequestOutput]:
        if self.grammar_gate:  # compiled grammars' requests join the queue (a failed compile fails its request)
            self.grammar_gate.release(self.scheduler, idle=not self.scheduler.has_unfinished())
        held = self.masks.hold() if self.masks else 0  # sequences whose grammar mask is not ready sit this out
        out = self.scheduler.schedule()
        if held and out.is_empty and not self.scheduler.failed:
            self.masks.wait(IDLE_WAIT_S)  # nothing else could run: wait a little for a mask instead of spinning
            return []
        return self._run_step(out, stream)

    def _run_step(self, out: SchedulerOutput, stream: bool) -> list[RequestOutput]:
        """The step the scheduler decided (``out``): execute, sample, book it, report."""
        scheduler = self.scheduler
        touched: dict[str, None] = {}
        if not out.is_empty:
            logits = self.runner.execute(out)
            samples = self._sample(out, logits)
            update = scheduler.update_from_output(out, samples)
            for seq, fault in self.sampling.take_faults().items():  # advanced with the rest (KV written), no token
                if not seq.is_finished:
                    scheduler.fail(seq, fault)
            self.masks.start(sample[0] for sample in samples)  # slow grammars' next masks, off this thread
            self.stats.prefill_tokens_computed += update.prefill_tokens
            self.stats.generated_tokens += update.generated
            self.stats.finished += update.finished
            touched = update.touched
        elif not scheduler.failed:
            if scheduler.has_unfinished():
                raise RuntimeError("the scheduler made no progress; this is a bug in pagedkv")
            return []
        for seq in scheduler.failed:  # plugin faults: these requests end with an error
            touched[seq.request_id] = None
            self.stats.failed += 1
        scheduler.failed.clear()
        self._observe(out)
        return self.outputs.emit(touched, stream)

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor) -> list[Sample]:
        """A token (and its logprobs, if asked for) for every sequence whose step computed its last token."""
        if self.masks:  # a matcher computing its mask ahead must be free before it samples or is forked
            self.masks.settle(item.seq for item in out.scheduled if item.samples)
        seqs, rows = sampling_rows(out, self._fork)
        return self.sampling.run(out, seqs, rows, logits)

    def _fork(self, parent: Sequence, computed: int) -> list[Sequence]:
        return self.requests.fork(parent, computed, self.allocator, self.scheduler)

    def _observe(self, out: SchedulerOutput) -> None:
        self.stats.observe_step(out, self.scheduler, self.pool.num_used, self.tokens_held, self.config.block_size)
        if self.events.enabled:
            events = self.events.drain()
            if self._step_observers:
                self._step_observers(events=events)

    def _observe_peak(self) -> None:
        """KV memory at the step's peak (before finished requests free their blocks): the summary's peak."""
        used = self.pool.num_used
        if used >= self.stats.peak_blocks_used:
            self.stats.observe_memory(used, self.tokens_held(), self.config.block_size, len(self.scheduler.running))

    def plugin_stats(self) -> dict[str, Any]:
        """Every plugin's counters (``pagedkv_report_stats``), merged."""
        return {k: v for answer in Observers(self.pm, "pagedkv_report_stats")() for k, v in answer.items()}

    def tokens_held(self) -> int:
        """Computed tokens in used blocks, counting a shared block once (for KV waste)."""
        forks = self._fork_hook is not None
        return tokens_held(self.scheduler, self.pool, self.config.block_size, self._sharing, forks)

    def kv_view(self) -> KVCacheView:
        """A read-only view of the KV cache and the requests holding it (for telemetry, tests)."""
        return KVCacheView(self.pool, self.scheduler, self.config.block_size, self.swap_space)

    def check_invariants(self) -> None:
        """See :func:`pagedkv.core.invariants.check_invariants`."""
        check_invariants(self)
