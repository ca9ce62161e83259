"""The engine: add requests, step, abort. Wires the pool, allocator, scheduler, runner and plugins.

One step is a straight line, as in vLLM and nano-vllm: the scheduler decides the step,
the runner computes it, the sampler draws tokens, and the scheduler's
``update_from_output`` does the bookkeeping (counters, full blocks, finishes); the
engine then reports outputs and events.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import torch

from pagedkv.core.block_pool import BlockPool
from pagedkv.core.config import EngineConfig
from pagedkv.core.errors import RequestRejected
from pagedkv.core.events import EventLog
from pagedkv.core.invariants import check_invariants
from pagedkv.core.kv_cache import KVCacheSpec, decide_max_model_len, decide_num_blocks, tensor_parallel_note
from pagedkv.core.plugin_guard import Observers, PluginFault, call_decision
from pagedkv.core.plugin_manager import build_registry, has_impls, make_plugin_manager
from pagedkv.core.request_check import check_prompt
from pagedkv.core.runner import Runner
from pagedkv.core.sampler import Sampler
from pagedkv.core.sampling_params import SamplingParams
from pagedkv.core.scheduler import SchedulerOutput
from pagedkv.core.sequence import RequestOutput, Sequence
from pagedkv.core.stats import RunStats, tokens_held
from pagedkv.core.stop_check import StopCheck, eos_token_ids_of


class Engine:
    """Streaming inference over a paged KV cache.

    ``model``/``tokenizer`` may be given already loaded (tests build tiny ones);
    otherwise ``config.model`` is loaded offline. With ``runner`` (see
    :class:`~pagedkv.core.runner.Runner`) no model is loaded at all: the runner's
    ``model_config`` sizes the cache and the runner computes each step
    (``engine simulate`` gives one that only counts tokens).
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        model: Any = None,
        tokenizer: Any = None,
        plugins: tuple[Any, ...] = (),
        runner: Runner | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        self.pm = make_plugin_manager(plugins)
        self.pm.hook.pagedkv_configure(config=config, pm=self.pm)
        backends = build_registry(self.pm, "backend", "pagedkv_register_backends")
        allocators = build_registry(self.pm, "allocator", "pagedkv_register_allocators")
        schedulers = build_registry(self.pm, "scheduler", "pagedkv_register_schedulers")
        backend_entry = backends.get(config.backend)  # fail on a bad name before loading anything
        allocator_entry = allocators.get(config.allocator)
        scheduler_entry = schedulers.get(config.scheduler)

        self.backend = None
        from_config = model is None
        if runner is None:
            from pagedkv.core.model_loader import prepare_model

            model, tokenizer = prepare_model(config, model, tokenizer)
            self.backend = backend_entry.factory(config)
        hf_config = runner.model_config if runner is not None else model.config
        self.model, self.tokenizer = model, tokenizer
        self.vocab_size = getattr(hf_config, "vocab_size", None) or 2**31
        self.spec = KVCacheSpec.from_model_config(hf_config, config.block_size, config.dtype)
        if config.tensor_parallel_size > 1 and runner is None:  # each rank holds its share of the KV heads
            from pagedkv.core.tensor_parallel import check_divisible, rank_spec

            check_divisible(hf_config, config.tensor_parallel_size)
            self.spec = rank_spec(self.spec, config.tensor_parallel_size)
        self.num_blocks = decide_num_blocks(config, self.spec, model)
        self.capacity_tokens = self.num_blocks * config.block_size
        self.max_model_len = decide_max_model_len(config, hf_config, self.capacity_tokens)

        self.events = EventLog(enabled=has_impls(self.pm, "pagedkv_on_step_events"))
        pool_hooks = self.pm.hook if has_impls(self.pm, "pagedkv_on_block_released") else None
        self.pool = BlockPool(self.num_blocks, hooks=pool_hooks, events=self.events)
        alloc_hooks = self.pm.hook if self._any_impl("pagedkv_match_prefix", "pagedkv_copy_on_write") else None
        self.allocator = allocator_entry.factory(self.pool, config.block_size, alloc_hooks)
        self._sharing = alloc_hooks is not None
        forks = has_impls(self.pm, "pagedkv_fork_after_prefill")
        self._fork_hook = self.pm.hook.pagedkv_fork_after_prefill if forks else None
        sched_hooks = self.pm.hook if self._any_impl("pagedkv_choose_preemption") else None
        self.scheduler = self._make_scheduler(scheduler_entry, sched_hooks)
        self.eos_token_ids: frozenset[int] = eos_token_ids_of(model, tokenizer)
        self.stop_check = StopCheck(self.eos_token_ids, tokenizer)
        self.scheduler.connect(self.stop_check, Observers(self.pm, "pagedkv_on_block_full"))
        self._step_observers = Observers(self.pm, "pagedkv_on_step_events")
        if runner is None and config.tensor_parallel_size > 1:
            from pagedkv.core.tp_runner import TensorParallelRunner

            runner = TensorParallelRunner.launch(config, model, self.backend, self.spec, self.num_blocks, from_config)
        elif runner is None:
            from pagedkv.core.model_runner import ModelRunner

            runner = ModelRunner(model, self.backend, self.spec, self.num_blocks, config.device)
        self.runner = runner
        self.sampler = Sampler(config.seed)
        self.stats = RunStats()
        self._groups: dict[str, list[Sequence]] = {}
        self._seq_keys: dict[int, int] = {}
        self._ids = itertools.count()
        self.pm.hook.pagedkv_engine_started(engine=self)

    def _make_scheduler(self, entry: Any, hooks: Any) -> Any:
        return entry.factory(self.config, self.allocator, self.events, hooks)

    def _any_impl(self, *hook_names: str) -> bool:
        return any(has_impls(self.pm, name) for name in hook_names)

    def capacity_line(self) -> str:
        c = self.config
        return (
            f"KV cache: {self.num_blocks} blocks of {c.block_size} tokens = {self.capacity_tokens} tokens; "
            f"max concurrency for {self.max_model_len}-token requests: "
            f"{self.capacity_tokens / self.max_model_len:.2f}x"
        ) + tensor_parallel_note(c.tensor_parallel_size, self.spec, self.num_blocks)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at exit); a tensor-parallel engine cannot step after."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- requests -------------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected("a text prompt needs a tokenizer; pass token ids instead")
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        return None, list(prompt)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request; raises :class:`RequestRejected` (and changes nothing) if it can never run."""
        params = params or SamplingParams()
        text, token_ids = self.encode_prompt(prompt)
        check_prompt(token_ids, self.vocab_size, self.max_model_len, self.num_blocks, self.config.block_size)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._groups:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        try:
            fork = params.n > 1 and bool(self._fork_hook and call_decision(self._fork_hook, params=params))
        except PluginFault as fault:
            raise RequestRejected(str(fault)) from fault
        seqs = []
        for index in range(1 if fork else params.n):
            seqs.append(self._new_sequence(request_id, token_ids, params, index, text, cache_salt))
        if fork:
            seqs[0].pending_forks = params.n - 1
        self._groups[request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)
        self.stats.requests += 1
        self.stats.prompt_tokens += len(token_ids) * params.n
        self.events.emit("request_add", request=request_id, prompt_tokens=len(token_ids), n=params.n)
        return request_id

    def _new_sequence(self, request_id: str, token_ids: list[int], params: SamplingParams, index: int,
                      text: str | None, cache_salt: str | None) -> Sequence:
        """Sample ``index`` of a request; with a seed, sample i uses seed + i."""
        if params.n > 1 and params.seed is not None:
            params = replace(params, seed=params.seed + index)
        seq = Sequence(
            request_id, list(token_ids), params, max_len=self.max_model_len, prompt=text, cache_salt=cache_salt
        )
        self._seq_keys[seq.seq_id] = next(self._ids)
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks go back to the pool. False if unknown."""
        seqs = self._groups.pop(request_id, None)
        if seqs is None:
            return False
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
            self._forget(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the step -----------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, stream: bool = True) -> list[RequestOutput]:
        """Run one engine step. Returns outputs of requests that finished (and, if
        ``stream``, of those that produced a token)."""
        return self._step(stream)

    def _step(self, stream: bool) -> list[RequestOutput]:
        scheduler = self.scheduler
        out = scheduler.schedule()
        touched: dict[str, None] = {}
        if not out.is_empty:
            logits = self.runner.execute(out)
            update = scheduler.update_from_output(out, self._sample(out, logits))
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
        return self._emit(touched, stream)

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor) -> list[tuple[Sequence, int]]:
        """A token for every sequence whose step computed its last token."""
        return self._draw(*self._sampling(out), logits)

    def _draw(self, seqs: list[Sequence], rows: list[int], logits: torch.Tensor) -> list[tuple[Sequence, int]]:
        if not seqs:
            return []
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(rows, device=logits.device)]
        banned = [self.stop_check.banned(s) if s.params.min_tokens else () for s in seqs]
        tokens = self.sampler.sample(logits, seqs, lambda s: self._seq_keys[s.seq_id], banned)
        return list(zip(seqs, tokens))

    def _sampling(self, out: SchedulerOutput) -> tuple[list[Sequence], list[int]]:
        """The sequences that sample and their logits rows (forked samples split off first: they share
        their parent's row but draw with their own generators)."""
        seqs: list[Sequence] = []
        rows: list[int] = []  # logits row of each sampling sequence
        row = 0
        for item in out.scheduled:
            if item.samples:
                seq = item.seq
                for sample in [seq, *self._fork(seq)] if seq.pending_forks else (seq,):
                    seqs.append(sample)
                    rows.append(row)
                row += 1
        return seqs, rows

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """After its prefill, split a parent into its n samples, sharing every block."""
        group = self._groups[parent.request_id]
        children = []
        for _ in range(parent.pending_forks):
            # parent.params carries seed + 0, so sample i gets seed + i as in an unforked request
            child = self._new_sequence(
                parent.request_id, parent.prompt_token_ids, parent.params, len(group), parent.prompt, parent.cache_salt
            )
            self.allocator.fork(parent, child)
            self.scheduler.add_running(child)
            group.append(child)
            children.append(child)
        self.stats.blocks_shared_by_fork += parent.pending_forks * len(parent.block_table)
        parent.pending_forks = 0
        self.events.emit("request_fork", request=parent.request_id, children=len(children))
        return children

    def _emit(self, touched: dict[str, None], stream: bool) -> list[RequestOutput]:
        outputs = []
        for request_id in touched:
            seqs = self._groups[request_id]
            finished = seqs[0].is_finished if len(seqs) == 1 else all(s.is_finished for s in seqs)
            if finished or stream:
                outputs.append(RequestOutput.of(request_id, seqs, finished, self.tokenizer))
            if finished:
                del self._groups[request_id]
                for seq in seqs:
                    self._forget(seq)
        return outputs

    def _observe(self, out: SchedulerOutput) -> None:
        self.stats.steps += 1
        self.stats.preemptions += len(out.preempted)
        self.stats.tokens_recomputed = self.scheduler.tokens_discarded
        running = len(self.scheduler.running)
        used = self.pool.num_used
        if used >= self.stats.peak_blocks_used:  # waste is recorded at the peak only: skip the count otherwise
            self.stats.observe_memory(used, self.tokens_held(), self.config.block_size, running)
        else:
            self.stats.peak_running = max(self.stats.peak_running, running)
        if self.events.enabled:
            events = self.events.drain()
            if self._step_observers:
                self._step_observers(events=events)

    def plugin_stats(self) -> dict[str, Any]:
        """Every plugin's counters (``pagedkv_report_stats``), merged."""
        merged: dict[str, Any] = {}
        for answer in Observers(self.pm, "pagedkv_report_stats")():
            merged.update(answer)
        return merged

    def tokens_held(self) -> int:
        """Computed tokens in used blocks, counting a shared block once (for KV waste)."""
        forks = self._fork_hook is not None
        return tokens_held(self.scheduler, self.pool, self.config.block_size, self._sharing, forks)

    def _forget(self, seq: Sequence) -> None:
        key = self._seq_keys.pop(seq.seq_id, None)
        if key is not None:
            self.sampler.forget(key)

    def check_invariants(self) -> None:
        """See :func:`pagedkv.core.invariants.check_invariants`."""
        check_invariants(self)
