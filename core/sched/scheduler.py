"""FCFS continuous batching with chunked prefill and preemption by recompute.

Each step has a token budget. Running sequences go first (oldest first): a
decode costs one token, an unfinished prompt takes the next chunk that fits.
Waiting sequences are then admitted in arrival order while budget, sequence
slots and blocks last. When a running sequence needs a block and none is left,
the newest running sequence is preempted: by default its blocks are freed and
it goes back to the front of the queue to be recomputed later; a plugin may
choose to swap it out to CPU memory instead (``pagedkv_choose_preemption``),
and swapped sequences come back before any new request is admitted.

After the model ran and tokens were sampled, :meth:`FCFSScheduler.update_from_output`
does the step's bookkeeping (vLLM's name; nano-vllm's ``postprocess``): computed counters,
full-block reports, new tokens, finishes.
"""

from __future__ import annotations

import itertools
import logging
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from operator import attrgetter

from pagedkv.core.events import EventLog
from pagedkv.core.kv.allocator_interface import Allocator
from pagedkv.core.kv.swap_space import SwapSpace
from pagedkv.core.plugin.plugin_guard import PluginFault
from pagedkv.core.sched.scheduler_interface import SchedulerHooks, SchedulingLimits
from pagedkv.core.sched.scheduler_output import Sample, ScheduledSeq, SchedulerOutput, StepUpdate
from pagedkv.core.sched.sequence import Sequence, SequenceStatus
from pagedkv.core.sched.stop_check import StopCheck

__all__ = ["FCFSScheduler", "PreemptionRecord", "Sample", "ScheduledSeq", "SchedulerOutput", "StepUpdate"]

WATERMARK = 0.01  # share of the pool kept free when admitting new requests
_run_order = attrgetter("run_order")
log = logging.getLogger("pagedkv.sched")  # --log-level debug: one line per admission, preemption, swap


@dataclass
class PreemptionRecord:
    request_id: str
    step: int
    tokens_discarded: int


class FCFSScheduler:
    """The reference :class:`~pagedkv.core.sched.scheduler_interface.Scheduler` (see the module docstring).

    ``stop_check`` is the engine's end-of-sequence rule (the default knows no EOS id and no tokenizer:
    only lengths and stop token ids end a sequence); ``hooks`` what it calls outside itself;
    ``swap_space`` where "swap" preemptions park their blocks (a plugin's), or None.
    """

    name = "fcfs"
    uses_priority = False

    def __init__(
        self, config: SchedulingLimits, allocator: Allocator, events: EventLog | None = None,
        hooks: SchedulerHooks | None = None, *, stop_check: StopCheck | None = None,
        swap_space: SwapSpace | None = None,
    ) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.allocator = allocator
        self.events = events or EventLog()
        self.stop_check = stop_check or StopCheck()
        hooks = hooks or SchedulerHooks()
        self.choose_preemption = hooks.choose_preemption
        self.on_block_full = hooks.on_block_full
        self.on_step_peak = hooks.on_step_peak
        self.swap_space = swap_space
        self.watermark_blocks = int(WATERMARK * allocator.pool.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.preemptions: list[PreemptionRecord] = []
        self.tokens_discarded = 0  # by preemptions by recompute, over the whole run
        self.failed: list[Sequence] = []  # finished by a plugin fault; the engine reports them
        self.step_index = 0
        self._run_orders = itertools.count()
        self._debug = log.isEnabledFor(logging.DEBUG)

    # --- queue management ---------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one joins it (its blocks are already shared)."""
        self._start_running(seq)

    def _start_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        seq.run_order = next(self._run_orders)  # so the running list is always sorted by run_order
        self.running.append(seq)

    def _remove_running(self, seq: Sequence) -> None:
        """O(log n) to find: the running list is sorted by run_order (a linear search is the fallback)."""
        running = self.running
        i = bisect_left(running, seq.run_order, key=_run_order)
        if i < len(running) and running[i] is seq:
            del running[i]
        elif seq in running:  # put there by hand, without a run_order
            running.remove(seq)
        # else: a preemption victim that a plugin failed, popped already

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def eviction_candidates(self, priority: int) -> list[Sequence]:
        """Waiting sequences a newcomer of ``priority`` may push out of a full queue, first first: none
        under FCFS (the newcomer waits its turn, or a server answers it 503)."""
        return []

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out of the queues and give back its blocks and its grammar state."""
        status = seq.status
        if status is SequenceStatus.RUNNING:
            self._remove_running(seq)
        elif status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.swap_space.free(seq)
        self.allocator.free(seq)
        # its grammar state goes now: whatever still refers to the finished sequence (a mask worker's
        # bookkeeping, an output) must not keep the matcher, and through it an evicted compiled grammar
        seq.matcher = None
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.events.emit("request_finish", request=seq.request_id, reason=reason, generated=len(seq.output_token_ids))

    # --- the step decision ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.step_index += 1
        out = self.new_output()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        return self._finish_schedule(out, budget)

    def new_output(self) -> SchedulerOutput:
        return SchedulerOutput()

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running sequences, oldest first, each its next chunk; preempt the newest when blocks run out."""
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.held:  # its grammar mask is not ready: it waits a step, the others do not wait for it
                i += 1
                continue
            uncomputed = len(seq.prompt_token_ids) + len(seq.output_token_ids) - seq.num_computed_tokens
            num_new = min(uncomputed, budget)
            while not self._allocate(seq, num_new):
                if seq.is_finished:  # a plugin fault failed it
                    break
                victim = self._pop_victim(i)  # the newest running sequence
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new, seq.num_computed_tokens))
                budget -= num_new
                i += 1
                continue
            if seq.is_finished:
                continue  # it left the running list; the next one moved up to index i
            break  # the sequence preempted itself: nothing newer is left to run
        return budget

    def _finish_schedule(self, out: SchedulerOutput, budget: int) -> SchedulerOutput:
        """After the running phase: swapped sequences back, then new ones, then the step's copies."""
        if not out.preempted:
            budget = self._swap_in(out, budget)
            if not self.swapped:
                self._admit_waiting(out, budget)
        out.block_copies.extend(self.allocator.take_copies())
        if self.events.enabled:
            for item in out.scheduled:
                self.events.emit("request_schedule", request=item.seq.request_id, tokens=item.num_new_tokens)
        return out

    def _allocate(self, seq: Sequence, num_new: int) -> bool:
        """``allocator.allocate_slots``, failing just this sequence if a plugin breaks."""
        try:
            return self.allocator.allocate_slots(seq, num_new)
        except PluginFault as fault:
            self.fail(seq, fault)
            return False

    def fail(self, seq: Sequence, fault: Exception) -> None:
        """End one sequence with an error; every other request goes on."""
        seq.error = str(fault)
        self.finish(seq, "error")
        self.failed.append(seq)

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        """Bring swapped sequences back, oldest first, while their blocks fit."""
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            num_new = min(seq.num_uncomputed, budget)
            blocks = self.allocator.blocks_to_reserve(seq, seq.num_computed_tokens + num_new)  # static: max_len
            if blocks > self.allocator.pool.num_available:
                break
            self.swapped.popleft()
            for host_block in self.swap_space.swap_in(seq):
                block = self.allocator.pool.allocate(seq.request_id)
                seq.block_table.append(block)
                out.swap_in.append((host_block, block))
                self.events.emit("block_swap_in", block=block, cpu_block=host_block, owner=seq.request_id)
            self.allocator.allocate_slots(seq, num_new)
            self._start_running(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new, seq.num_computed_tokens))
            budget -= num_new
            self.events.emit("request_swap_in", request=seq.request_id)
            if self._debug:
                log.debug("step %d: swap in %s (%d blocks back from CPU)", self.step_index, seq.request_id,
                          len(seq.block_table))
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            try:
                self.allocator.match_prefix(seq)
            except PluginFault as fault:
                self.fail(seq, fault)
                continue
            num_new = min(seq.num_uncomputed, budget)
            # Keep a few blocks free for the running sequences to grow into (vLLM's watermark): admitting
            # into the last free blocks only buys a preemption a few steps later.
            headroom = self.allocator.pool.num_available - self.allocator.num_new_blocks(seq, num_new)
            crowded = self.running and headroom < self.watermark_blocks
            if crowded or not self.allocator.allocate_slots(seq, num_new):
                if seq.num_computed_tokens:  # give back a prefix match it cannot use yet
                    self.allocator.free(seq)
                    seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = seq.num_computed_tokens
            if self._debug:
                log.debug("step %d: admit %s (%d prompt tokens, %d from the prefix cache; %d blocks free)",
                          self.step_index, seq.request_id, len(seq.prompt_token_ids), seq.num_computed_tokens,
                          self.allocator.pool.num_available)
            self._start_running(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new, seq.num_computed_tokens))
            budget -= num_new

    def _pop_victim(self, first: int) -> Sequence:
        """Take the sequence to preempt out of ``running[first:]`` (those not yet scheduled this step):
        FCFS takes the newest."""
        return self.running.pop()

    def _requeue(self, seq: Sequence) -> None:
        """A sequence preempted by recompute goes back to the front of the queue: started work first."""
        self.waiting.appendleft(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Swap out if a plugin says so and can; otherwise free everything, to be recomputed later."""
        choose = self.choose_preemption
        try:
            choice = choose(seq=seq, scheduler=self) if choose is not None else None
        except PluginFault as fault:
            self.fail(seq, fault)  # frees its blocks just as a preemption would
            return
        if choice == "swap" and self.swap_space is not None and self._swap_out(seq, out):
            return
        self._preempt_by_recompute(seq, out)

    def _swap_out(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Park ``seq``'s blocks in the swap space and free them here; False if they do not fit there."""
        host_blocks = self.swap_space.swap_out(seq)
        if host_blocks is None:
            return False
        pairs = list(zip(seq.block_table, host_blocks))
        for block, host_block in pairs:
            self.events.emit("block_swap_out", block=block, cpu_block=host_block, owner=seq.request_id)
        self.allocator.free(seq)
        out.swap_out.extend(pairs)
        seq.status = SequenceStatus.SWAPPED
        seq.num_preemptions += 1
        self.swapped.append(seq)
        out.preempted.append(seq)
        self.events.emit("request_swap_out", request=seq.request_id, blocks=len(pairs))
        if self._debug:
            log.debug("step %d: preempt %s by swap: %d blocks to CPU", self.step_index, seq.request_id, len(pairs))
        return True

    def _preempt_by_recompute(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free every block of ``seq`` and queue it again: its computed tokens are recomputed later."""
        discarded = seq.num_computed_tokens
        self.allocator.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self._requeue(seq)
        out.preempted.append(seq)
        self.preemptions.append(PreemptionRecord(seq.request_id, self.step_index, discarded))
        self.tokens_discarded += discarded
        self.events.emit("request_preempt", request=seq.request_id, tokens_discarded=discarded)
        if self._debug:
            log.debug("step %d: preempt %s by recompute: %d computed tokens dropped (%d blocks free)",
                      self.step_index, seq.request_id, discarded, self.allocator.pool.num_available)

    # --- after the step: bookkeeping ------------------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, samples: list[Sample]) -> StepUpdate:
        """The step ran and ``samples`` (sequence, token, logprobs or None) were drawn: count computed
        tokens, report full blocks, append the tokens and finish the sequences they end, in scheduled order."""
        update = StepUpdate()
        for item in out.scheduled:
            self._advance(item.seq, item.num_new_tokens, update)
        self._probe_peak()
        for seq, token, logprobs in samples:
            self._take_token(seq, token, logprobs, update)
        return update

    def _probe_peak(self) -> None:
        """The step's KV memory is at its peak now: its tokens are in the cache, no finished sequence freed
        its blocks yet (the run summary's peak blocks and waste are measured here)."""
        if self.on_step_peak is not None:
            self.on_step_peak()

    def computed_tokens(self) -> int:
        """Computed tokens over the running sequences (each counted in full)."""
        return sum(s.num_computed_tokens for s in self.running)

    def _advance(self, seq: Sequence, num_new: int, update: StepUpdate) -> None:
        before = seq.num_computed_tokens
        seq.num_computed_tokens = after = before + num_new
        prompt_len = len(seq.prompt_token_ids)
        if before < prompt_len:
            update.prefill_tokens += min(after, prompt_len) - before
        if self.on_block_full is not None:
            self._report_full_blocks(seq, before)

    def _report_full_blocks(self, seq: Sequence, before: int) -> None:
        """``pagedkv_on_block_full`` for every block the tokens past ``before`` completed."""
        bs = self.allocator.block_size
        for logical in range(before // bs, seq.num_computed_tokens // bs):
            self.on_block_full(seq=seq, logical_index=logical, block_id=seq.block_table[logical])

    def _take_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None, update: StepUpdate) -> None:
        """One sequence's new token: append it, finish the sequence if it ends there (per sequence, so
        a failure ends its request alone; a row the sampler could not draw never arrives here: the engine
        fails it after this update, see :meth:`~pagedkv.core.step_sampling.StepSampling.draw`)."""
        seq.append_token(token, logprobs)
        update.generated += 1
        self._finish_if_done(seq, token, update)

    def _finish_if_done(self, seq: Sequence, token: int, update: StepUpdate) -> None:
        """Finish ``seq`` if ``token`` (appended already) ends it; a failing check ends this request alone."""
        update.touched[seq.request_id] = None
        try:
            ended = self.stop_check(seq, token)
        except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer failing on a stop string: not the others' problem
            seq.pop_token()  # the token was never accepted
            update.generated -= 1
            self.fail(seq, RuntimeError(f"the stop check failed: {type(exc).__name__}: {exc}"))
            return
        if ended is not None:
            seq.stop_reason = ended[1]
            self.finish(seq, ended[0])
            update.finished += 1
