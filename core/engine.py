"""The engine: add requests, step, abort. Owns the pool, allocator, scheduler and model runner.

One step is a straight line: schedule -> build metadata and run the model ->
sample -> append tokens, finish sequences, free blocks -> emit events.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import replace
from typing import Any

import torch

from pagedkv.core.block_pool import BlockPool
from pagedkv.core.config import EngineConfig
from pagedkv.core.errors import ConfigError, RequestRejected
from pagedkv.core.events import EventLog
from pagedkv.core.kv_cache import KVCacheSpec
from pagedkv.core.plugin_guard import Observers, PluginFault, call_decision
from pagedkv.core.plugin_manager import build_registry, has_impls, make_plugin_manager
from pagedkv.core.sampler import Sampler
from pagedkv.core.sampling_params import SamplingParams
from pagedkv.core.scheduler import SchedulerOutput
from pagedkv.core.sequence import CompletionOutput, RequestOutput, Sequence, SequenceStatus
from pagedkv.core.simulated_runner import SimulatedRunner
from pagedkv.core.stats import RunStats

log = logging.getLogger("pagedkv")

_DEFAULT_CPU_KV_BYTES = 1 << 30
_DEFAULT_GPU_UTILIZATION = 0.9


class Engine:
    """Streaming inference over a paged KV cache.

    ``model``/``tokenizer`` may be given already loaded (tests build tiny ones);
    otherwise ``config.model`` is loaded offline. With ``simulate`` (an HF model
    config, or anything with its shape fields) no model is loaded at all: a
    stand-in runner produces token counts only, and the same pool, allocator,
    scheduler and plugins run as in a real engine (``engine simulate``); there,
    unless ``decode_lane`` is False or a plugin needs to see every sequence each
    step, sequences in steady decode ride a :class:`DecodeLane` on non-streaming
    steps (same decisions, far less per-step work).
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        model: Any = None,
        tokenizer: Any = None,
        plugins: tuple[Any, ...] = (),
        simulate: Any = None,
        decode_lane: bool = True,
    ) -> None:
        self.config = config = config or EngineConfig()
        self.pm = make_plugin_manager(plugins)
        self.pm.hook.pagedkv_configure(config=config, pm=self.pm)
        backends = build_registry(self.pm, "backend", "pagedkv_register_backends")
        allocators = build_registry(self.pm, "allocator", "pagedkv_register_allocators")
        schedulers = build_registry(self.pm, "scheduler", "pagedkv_register_schedulers")
        if config.backend == "auto":  # the compiled CPU kernel on CPU (it falls back to torch without g++)
            config.backend = "cpu" if config.device == "cpu" and "cpu" in backends.names() else "torch"
        backend_entry = backends.get(config.backend)  # fail on a bad name before loading anything
        allocator_entry = allocators.get(config.allocator)
        scheduler_entry = schedulers.get(config.scheduler)

        if simulate is not None:
            hf_config, self.backend = simulate, None
        else:
            if model is None:
                from pagedkv.core.model_loader import load_model

                model, tokenizer, _ = load_model(config.model, config.dtype, config.device)
            else:
                model = model.to(device=config.device, dtype=config.dtype).eval()
            hf_config = model.config
            self.backend = backend_entry.factory(config)
        self.model, self.tokenizer = model, tokenizer
        self.vocab_size = getattr(hf_config, "vocab_size", None) or 2**31
        self.spec = KVCacheSpec.from_model_config(hf_config, config.block_size, config.dtype)
        self.num_blocks = self._decide_num_blocks()
        self.capacity_tokens = self.num_blocks * config.block_size
        self.max_model_len = self._decide_max_model_len(hf_config)

        self.events = EventLog(enabled=has_impls(self.pm, "pagedkv_on_step_events"))
        pool_hooks = self.pm.hook if has_impls(self.pm, "pagedkv_on_block_released") else None
        self.pool = BlockPool(self.num_blocks, hooks=pool_hooks, events=self.events)
        alloc_hooks = self.pm.hook if self._any_impl("pagedkv_match_prefix", "pagedkv_copy_on_write") else None
        self.allocator = allocator_entry.factory(self.pool, config.block_size, alloc_hooks)
        sched_hooks = self.pm.hook if self._any_impl("pagedkv_choose_preemption") else None
        self.scheduler = scheduler_entry.factory(config, self.allocator, self.events, sched_hooks)
        self._block_full_hook = Observers(self.pm, "pagedkv_on_block_full")
        self._step_observers = Observers(self.pm, "pagedkv_on_step_events")
        self._fork_hook = self.pm.hook.pagedkv_fork_after_prefill if has_impls(
            self.pm, "pagedkv_fork_after_prefill"
        ) else None

        if simulate is not None:
            self.runner = SimulatedRunner()
            self.eos_token_ids: frozenset[int] = frozenset()
        else:
            from pagedkv.core.model_runner import ModelRunner

            self.runner = ModelRunner(model, self.backend, self.spec, self.num_blocks, config.device)
            self.eos_token_ids = _eos_ids(model, tokenizer)
        self.sampler = Sampler(config.seed)
        self._sharing = alloc_hooks is not None
        self._lane = None
        # The lane needs every shared block to be full (no forks, no copy-on-write) and step-event listeners
        # that follow it (telemetry does). Prefix caching is fine (it sees allocations and full blocks), and
        # so is swap: preemptions only happen on steps the lane has flushed, so its plugin sees exact sequences.
        from pagedkv.core.decode_lane import DecodeLane, lane_reproduces

        listeners = self.pm.hook.pagedkv_on_step_events.get_hookimpls()
        if simulate is not None and decode_lane and not (
            self._fork_hook or has_impls(self.pm, "pagedkv_copy_on_write")
            or not all(getattr(impl.plugin, "follows_decode_lane", False) for impl in listeners)
        ) and lane_reproduces(self.scheduler, self.allocator):
            self._lane = self.scheduler.lane = DecodeLane(
                config.block_size, token=SimulatedRunner.TOKEN, report_fills=bool(self._block_full_hook)
            )
        self.stats = RunStats()
        self._groups: dict[str, list[Sequence]] = {}
        self._seq_keys: dict[int, int] = {}
        self._ids = itertools.count()
        self.pm.hook.pagedkv_engine_started(engine=self)

    def _any_impl(self, *hook_names: str) -> bool:
        return any(has_impls(self.pm, name) for name in hook_names)

    # --- sizing -------------------------------------------------------------------------------------

    def _decide_num_blocks(self) -> int:
        c = self.config
        per_block = self.spec.bytes_per_block
        if c.num_blocks is not None:
            return c.num_blocks
        if c.kv_cache_memory is not None:
            budget = int(c.kv_cache_memory)
        elif c.device.startswith("cuda"):
            budget = self._profile_gpu_budget(c.gpu_memory_utilization or _DEFAULT_GPU_UTILIZATION)
        else:
            budget = _DEFAULT_CPU_KV_BYTES
        blocks = budget // per_block
        if blocks < 1:
            raise ConfigError(
                f"the KV budget ({budget} bytes) is below one block ({per_block} bytes at block_size "
                f"{c.block_size}); give a larger kv_cache_memory or a smaller block_size"
            )
        return blocks

    def _profile_gpu_budget(self, utilization: float) -> int:
        """vLLM's way: run the largest step once, then give the KV cache what is left."""
        device = torch.device(self.config.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        tokens = min(self.config.max_num_batched_tokens, 2048)
        with torch.inference_mode():
            self.model(input_ids=torch.zeros((1, tokens), dtype=torch.long, device=device), use_cache=False)
        peak = torch.cuda.max_memory_allocated(device)
        total = torch.cuda.get_device_properties(device).total_memory
        return int(total * utilization) - peak

    def _decide_max_model_len(self, hf_config: Any) -> int:
        model_limit = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)
        wanted = self.config.max_model_len
        if wanted is not None and model_limit is not None and wanted > model_limit:
            raise ConfigError(f"max_model_len {wanted} is above the model's limit of {model_limit} positions")
        limit = wanted or model_limit or self.capacity_tokens
        return min(limit, self.capacity_tokens)

    def capacity_line(self) -> str:
        c = self.config
        return (
            f"KV cache: {self.num_blocks} blocks of {c.block_size} tokens = {self.capacity_tokens} tokens; "
            f"max concurrency for {self.max_model_len}-token requests: "
            f"{self.capacity_tokens / self.max_model_len:.2f}x"
        )

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
        self._validate(token_ids)
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

    def _new_sequence(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        index: int,
        text: str | None,
        cache_salt: str | None,
    ) -> Sequence:
        """Sample ``index`` of a request; with a seed, sample i uses seed + i."""
        if params.n > 1 and params.seed is not None:
            params = replace(params, seed=params.seed + index)
        seq = Sequence(
            request_id, list(token_ids), params, max_len=self.max_model_len, prompt=text, cache_salt=cache_salt
        )
        self._seq_keys[seq.seq_id] = next(self._ids)
        return seq

    def _validate(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise RequestRejected("the prompt is empty; give at least one token")
        plain_ints = set(map(type, token_ids)) == {int}  # C-speed check for the usual case
        if not plain_ints and not all(isinstance(t, int) for t in token_ids) or not (
            0 <= min(token_ids) and max(token_ids) < self.vocab_size
        ):
            raise RequestRejected(f"prompt token ids must be integers in 0..{self.vocab_size - 1}")
        if len(token_ids) > self.max_model_len:
            if self.max_model_len == self.capacity_tokens:
                raise RequestRejected(
                    f"the prompt has {len(token_ids)} tokens but the whole KV cache holds only "
                    f"{self.capacity_tokens} ({self.num_blocks} blocks of {self.config.block_size}); "
                    "give a larger KV budget or a shorter prompt"
                )
            raise RequestRejected(
                f"the prompt has {len(token_ids)} tokens, more than max_model_len={self.max_model_len}"
            )

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
        lane = self._lane
        if lane is not None and stream and lane.members:
            lane.flush()  # a streaming step reports every sequence's new token: they must be exact
        out = self.scheduler.schedule()
        touched: list[str] = []
        if not out.is_empty:
            touched = self._update(out, self.runner.execute(out), lane if not stream else None)
        elif not self.scheduler.failed:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler made no progress; this is a bug in pagedkv")
            return []
        for seq in self.scheduler.failed:  # plugin faults: these requests end with an error
            if seq.request_id not in touched:
                touched.append(seq.request_id)
            self.stats.failed += 1
        self.scheduler.failed.clear()
        self._observe(out)
        outputs = []
        for request_id in touched:
            seqs = self._groups[request_id]
            finished = seqs[0].is_finished if len(seqs) == 1 else all(s.is_finished for s in seqs)
            if finished or stream:
                outputs.append(self._make_output(request_id, seqs, finished))
            if finished:
                del self._groups[request_id]
                for seq in seqs:
                    self._forget(seq)
        return outputs

    def _update(self, out: SchedulerOutput, logits: torch.Tensor, lane: Any = None) -> list[str]:
        """Count the step's tokens, sample, finish; with ``lane``, let sequences that now decode join it."""
        sampling: list[Sequence] = []
        rows: list[int] = []  # logits row of each sampling sequence
        row = 0
        report_full = bool(self._block_full_hook)  # once per step: this loop is the simulator's hot path
        ended: list[Sequence] = []
        filled: list[Sequence] = []  # lane members whose block filled: reported in running order among the rest
        owed: list[Sequence] = []  # lane members brought up to date but for this step's token
        if out.lane_decodes:
            ended, filled, owed = self._lane.advance()
        for item in out.scheduled:
            seq = item.seq
            while filled and filled[0].run_order < seq.run_order:
                seq_filled = filled.pop(0)  # (its counters are up to date: one block filled with its last token)
                self._report_full_blocks(seq_filled, seq_filled.num_computed_tokens - 1)
            before = seq.num_computed_tokens
            seq.num_computed_tokens = after = before + item.num_new_tokens
            prompt_len = len(seq.prompt_token_ids)
            if before < prompt_len:
                self.stats.prefill_tokens_computed += min(after, prompt_len) - before
            if report_full:
                self._report_full_blocks(seq, before)
            if after == prompt_len + len(seq.output_token_ids):  # the step computed its last token: sample
                if seq.pending_forks:
                    for child in [seq, *self._fork(seq)]:  # forked samples share the parent's logits row
                        sampling.append(child)
                        rows.append(row)
                else:
                    sampling.append(seq)
                    rows.append(row)
                row += 1
        for seq in filled:
            self._report_full_blocks(seq, seq.num_computed_tokens - 1)
        tokens: list[int] = []
        if sampling:
            if len(rows) != logits.shape[0]:
                logits = logits[torch.tensor(rows, device=logits.device)]
            banned = [self._banned(s) if s.params.min_tokens else () for s in sampling]
            tokens = self.sampler.sample(logits, sampling, lambda s: self._seq_keys[s.seq_id], banned)
        touched: dict[str, None] = {}
        for seq, token in zip(sampling, tokens):
            seq.output_token_ids.append(token)
            self.stats.generated_tokens += 1
        if out.lane_decodes:
            self.stats.generated_tokens += out.lane_decodes
            for seq in owed:
                seq.output_token_ids.append(self._lane.token)
        if ended:  # finish in running order, as one-by-one stepping does (freed block ids depend on it)
            merged = sorted([*zip(sampling, tokens), *((s, self._lane.token) for s in ended)],
                            key=lambda pair: pair[0].run_order)
            sampling, tokens = [p[0] for p in merged], [p[1] for p in merged]
        for seq, token in zip(sampling, tokens):
            self._check_finish(seq, token)
            touched[seq.request_id] = None
        if lane is not None:
            for seq in sampling:
                if seq.status is SequenceStatus.RUNNING:
                    self._join_lane(lane, seq)
        return list(touched)

    def _join_lane(self, lane: Any, seq: Sequence) -> None:
        """A sequence that sampled and goes on decoding rides the lane if its end is fixed by length."""
        if seq not in lane.outside:
            raise RuntimeError(f"decode lane out of step: {seq.request_id} should have finished")
        p = seq.params
        if p.stop_token_ids or p.stop or seq.pending_forks or self.eos_token_ids:
            return  # a token could end it: it stays outside and is stepped one by one
        n_out = len(seq.output_token_ids)
        lane.join(seq, min(p.max_tokens - n_out, seq.max_len - len(seq.prompt_token_ids) - n_out))
        self.events.emit("request_decode", request=seq.request_id, computed=seq.num_computed_tokens, generated=n_out)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """After its prefill, split a parent into its n samples, sharing every block."""
        if not parent.pending_forks:
            return []
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

    def _report_full_blocks(self, seq: Sequence, before: int) -> None:
        bs = self.config.block_size
        for logical in range(before // bs, seq.num_computed_tokens // bs):
            self._block_full_hook(seq=seq, logical_index=logical, block_id=seq.block_table[logical])

    def _banned(self, seq: Sequence) -> list[int]:
        p = seq.params
        if len(seq.output_token_ids) >= p.min_tokens:
            return []
        return ([] if p.ignore_eos else list(self.eos_token_ids)) + list(p.stop_token_ids)

    def _check_finish(self, seq: Sequence, token: int) -> None:
        p = seq.params
        reason, stop_reason = None, None
        if not p.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif token in p.stop_token_ids:
            reason, stop_reason = "stop", token
        elif (n_out := len(seq.output_token_ids)) >= p.max_tokens or len(seq.prompt_token_ids) + n_out >= seq.max_len:
            reason = "length"
        if p.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            for s in p.stop:
                cut = text.find(s)
                if cut >= 0:
                    seq.output_text = text[:cut]
                    reason, stop_reason = "stop", s
                    break
        if reason is not None:
            seq.stop_reason = stop_reason
            self.scheduler.finish(seq, reason)
            self.stats.finished += 1

    def _observe(self, out: SchedulerOutput) -> None:
        self.stats.steps += 1
        self.stats.preemptions += len(out.preempted)
        self.stats.tokens_recomputed = self.scheduler.tokens_discarded
        running = self.scheduler.running
        used = self.pool.num_used
        if used >= self.stats.peak_blocks_used:  # waste is recorded at the peak only: skip the count otherwise
            self.stats.observe_memory(used, self._tokens_held(), self.config.block_size, len(running))
        else:
            self.stats.peak_running = max(self.stats.peak_running, len(running))
        if self.events.enabled:
            events = self.events.drain()
            if self._step_observers:
                self._step_observers(events=events)

    def plugin_stats(self) -> dict[str, Any]:
        """Every plugin's counters (``pagedkv_report_stats``), merged (a plugin may read the sequences: exact)."""
        if self._lane is not None:
            self._lane.flush()
        merged: dict[str, Any] = {}
        for answer in Observers(self.pm, "pagedkv_report_stats")():
            merged.update(answer)
        return merged

    def _tokens_held(self) -> int:
        """Computed tokens in used blocks, counting a shared block once."""
        if not self._sharing:  # nothing is shared: a cheap sum will do
            return self._computed_running()
        if self._lane is not None:  # sharing without forks: every shared block is full for all its holders
            return self._computed_running() - self.config.block_size * self.pool.shared_refs
        # A block is full if any holder has computed past it; only each sequence's last block can be
        # partly filled. So: a C-level set union of the full prefixes, plus the partial tails not in it.
        bs = self.config.block_size
        full: set[int] = set()
        partial: dict[int, int] = {}
        for seq in self.scheduler.running:
            n = seq.num_computed_tokens
            blocks = seq.block_table.blocks
            k, rest = divmod(n, bs)
            if k:
                full.update(blocks[:k])
            if rest and k < len(blocks) and partial.get(blocks[k], 0) < rest:
                partial[blocks[k]] = rest
        return bs * len(full) + sum(f for block_id, f in partial.items() if block_id not in full)

    def _computed_running(self) -> int:
        """Computed tokens over the running sequences (each counted in full)."""
        if self._lane is not None:  # the running list is the lane plus the few outside it
            return self._lane.tokens() + sum(s.num_computed_tokens for s in self._lane.outside)
        return sum(s.num_computed_tokens for s in self.scheduler.running)

    def _make_output(self, request_id: str, seqs: list[Sequence], finished: bool) -> RequestOutput:
        completions = []
        for index, seq in enumerate(seqs):
            if seq.stop_reason is None or not isinstance(seq.stop_reason, str):
                seq.output_text = self._decode(seq.output_token_ids)
            completions.append(
                CompletionOutput(
                    index, seq.output_text, list(seq.output_token_ids), seq.finish_reason, seq.stop_reason, seq.error
                )
            )
        first = seqs[0]
        return RequestOutput(request_id, first.prompt, list(first.prompt_token_ids), completions, finished)

    def _decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _forget(self, seq: Sequence) -> None:
        key = self._seq_keys.pop(seq.seq_id, None)
        if key is not None:
            self.sampler.forget(key)

    def check_invariants(self) -> None:
        """Every block is free, owned by exactly its holders, or kept; queues agree with states.

        Used by tests after every operation; cheap enough for debugging runs too. It flushes the
        decode lane first, so every sequence's counters are exact.
        """
        self.pool.check()
        sched = self.scheduler
        if self._lane is not None:  # the lane merges by run_order: the running list must be sorted by it
            self._lane.flush()
            assert set(self._lane.outside) == set(sched.running), "the decode lane lost track of a running sequence"
            assert [s.run_order for s in sched.running] == sorted(s.run_order for s in sched.running)
        bs = self.config.block_size
        queues = [(sched.running, SequenceStatus.RUNNING), (sched.waiting, SequenceStatus.WAITING),
                  (sched.swapped, SequenceStatus.SWAPPED)]
        seen: set[int] = set()
        holders: dict[int, int] = {}
        for queue, status in queues:
            for seq in queue:
                assert seq.seq_id not in seen, f"sequence {seq.request_id} is in two queues"
                seen.add(seq.seq_id)
                assert seq.status is status, f"{seq.request_id} is {seq.status} but queued as {status}"
                assert seq.num_computed_tokens <= seq.num_tokens
                if status is SequenceStatus.SWAPPED:  # its computed tokens live in the CPU pool
                    assert not len(seq.block_table), "a swapped sequence holds device blocks"
                else:
                    assert len(seq.block_table) * bs >= seq.num_computed_tokens
                for block_id in seq.block_table:
                    holders[block_id] = holders.get(block_id, 0) + 1
        for block_id, refs in enumerate(self.pool.ref_counts):
            assert refs == holders.get(block_id, 0), f"block {block_id}: ref {refs}, held {holders.get(block_id)}"


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        ids.update(value if isinstance(value, (list, tuple)) else [value])
        break
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
