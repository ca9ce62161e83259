"""FCFS continuous batching with chunked prefill and preemption by recompute.

Each step has a token budget. Running sequences go first (oldest first): a
decode costs one token, an unfinished prompt takes the next chunk that fits.
Waiting sequences are then admitted in arrival order while budget, sequence
slots and blocks last. When a running sequence needs a block and none is left,
the newest running sequence is preempted: by default its blocks are freed and
it goes back to the front of the queue to be recomputed later; a plugin may
choose to swap it out to CPU memory instead (``pagedkv_choose_preemption``),
and swapped sequences come back before any new request is admitted.

A simulated engine attaches a :class:`~pagedkv.core.decode_lane.DecodeLane`:
sequences in steady decode then need no per-step work, and the running phase
touches only those crossing a block boundary and those outside the lane. When
that shortcut could decide differently (a preemption is possible, or the budget
does not cover the whole batch) the lane is flushed and the step runs one
sequence at a time, as without it.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from pagedkv.core.events import EventLog
from pagedkv.core.plugin_guard import PluginFault, call_decision
from pagedkv.core.sequence import Sequence, SequenceStatus

WATERMARK = 0.01  # share of the pool kept free when admitting new requests
_run_order = attrgetter("run_order")


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    context_len: int  # tokens already cached before this step

    @property
    def samples(self) -> bool:
        """True when this step computes the sequence's last known token, so a new one is sampled."""
        return self.context_len + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), copy-on-write
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    lane_decodes: int = 0  # decode-lane sequences also stepped (one token each); not in ``scheduled``
    lane_context: int = 0  # their cached tokens before this step, summed

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled) + self.lane_decodes

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.lane_decodes


@dataclass
class PreemptionRecord:
    request_id: str
    step: int
    tokens_discarded: int


class FCFSScheduler:
    name = "fcfs"

    def __init__(self, config: Any, allocator: Any, events: EventLog | None = None, hooks: Any = None) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.allocator = allocator
        self.events = events or EventLog()
        self.hooks = hooks
        self.swapper: Any = None  # attached by a swap plugin: swap_out(seq), swap_in(seq), free(seq)
        self.watermark_blocks = int(WATERMARK * allocator.pool.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.preemptions: list[PreemptionRecord] = []
        self.tokens_discarded = 0  # by preemptions by recompute, over the whole run
        self.failed: list[Sequence] = []  # finished by a plugin fault; the engine reports them
        self.step_index = 0
        self.lane: Any = None  # a DecodeLane, attached by a simulated engine
        self._run_orders = itertools.count()

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
        if self.lane is not None:
            self.lane.enter(seq)

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

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out of the queues and give back its blocks."""
        status = seq.status
        if status is SequenceStatus.RUNNING:
            self._remove_running(seq)
            if self.lane is not None:
                self.lane.discard(seq)
        elif status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.swapper.free(seq)
        self.allocator.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.events.emit("request_finish", request=seq.request_id, reason=reason, generated=len(seq.output_token_ids))

    # --- the step decision ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.step_index += 1
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        lane = self.lane
        if lane is not None and lane.members:
            left = self._schedule_with_lane(lane, out)
            if left is not None:
                return self._finish_schedule(out, left)
            lane.flush()  # this step may preempt or ration the budget: take it one sequence at a time

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            uncomputed = len(seq.prompt_token_ids) + len(seq.output_token_ids) - seq.num_computed_tokens
            num_new = min(uncomputed, budget)
            while not self._allocate(seq, num_new):
                if seq.is_finished:  # a plugin fault failed it
                    break
                victim = self.running.pop()  # the newest running sequence
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
        return self._finish_schedule(out, budget)

    def _finish_schedule(self, out: SchedulerOutput, budget: int) -> SchedulerOutput:
        """After the running phase: swapped sequences back, then new ones, then the step's copies."""
        if not out.preempted:
            budget = self._swap_in(out, budget)
            if not self.swapped:
                self._admit_waiting(out, budget)
        out.block_copies.extend(self.allocator.pending_copies)
        self.allocator.pending_copies.clear()
        if self.events.enabled:
            for item in out.scheduled:
                self.events.emit("request_schedule", request=item.seq.request_id, tokens=item.num_new_tokens)
        return out

    def _schedule_with_lane(self, lane: Any, out: SchedulerOutput) -> int | None:
        """The running phase with a decode lane; returns the budget left, or None if the step must go one by one.

        Every lane member gets its one token; the few running sequences outside the lane get
        what the one-by-one loop would give them. Blocks are handed out in running order, as
        that loop does, so block ids come out the same. Declines when the budget would run
        out before a lane member or when the step's new blocks might not all fit.
        """
        budget = self.max_num_batched_tokens
        members = len(lane.members)
        outside = sorted(lane.outside, key=_run_order) if lane.outside else []
        wants = [s.num_tokens - s.num_computed_tokens for s in outside]
        if members + sum(wants) <= budget:
            grants = wants
        elif members < budget and outside[0].run_order > lane.newest:  # every member is ahead of them
            left, grants = budget - members, []
            for want in wants:
                if left <= 0:
                    break
                grants.append(min(want, left))
                left -= grants[-1]
        else:
            return None
        due = lane.due_crossings()
        allocator = self.allocator
        new_blocks = {s: allocator.num_new_blocks(s, g) for s, g in zip(outside, grants)}
        needed = len(due) + sum(new_blocks.values())
        if needed > allocator.pool.num_available:
            return None
        out.lane_decodes, out.lane_context = members, lane.tokens()
        order = sorted(due + outside[: len(grants)], key=_run_order) if grants else due
        if allocator.hooks is None:  # in running order: the block ids the one-by-one loop would give
            pool = allocator.pool
            batch = None if pool.events.enabled else iter(pool.allocate_many(needed))  # (events name owners)
            for seq in order:
                count = new_blocks.get(seq, 1)  # a lane member crossing into a new block needs one
                if count:
                    blocks = itertools.islice(batch, count) if batch else pool.allocate_many(count, seq.request_id)
                    seq.block_table.blocks.extend(blocks)
        else:  # plugins see each allocation as the one-by-one loop makes it (reclaiming cached blocks, ...)
            granted = dict(zip(outside, grants))
            for seq in order:
                num_new = granted.get(seq)
                if num_new is None:
                    seq.block_table.append(allocator.pool.allocate(seq.request_id))
                elif not allocator.allocate_slots(seq, num_new):
                    raise RuntimeError("blocks counted as available could not be allocated; this is a bug in pagedkv")
        for seq, num_new in zip(outside, grants):
            out.scheduled.append(ScheduledSeq(seq, num_new, seq.num_computed_tokens))
        lane.take_crossings(due)
        return budget - members - sum(grants)

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
            out.swap_in.extend(self.swapper.swap_in(seq))
            self.allocator.allocate_slots(seq, num_new)
            self._start_running(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new, seq.num_computed_tokens))
            budget -= num_new
            self.events.emit("request_swap_in", request=seq.request_id)
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
            self._start_running(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new, seq.num_computed_tokens))
            budget -= num_new

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Swap out if a plugin says so and can; otherwise free everything, to be recomputed later."""
        if self.lane is not None:
            self.lane.discard(seq)  # it has left the running list already
        choice = None
        try:
            if self.hooks is not None:
                choice = call_decision(self.hooks.pagedkv_choose_preemption, seq=seq, scheduler=self)
        except PluginFault as fault:
            self.fail(seq, fault)  # frees its blocks just as a preemption would
            return
        if choice == "swap" and self.swapper is not None:
            pairs = self.swapper.swap_out(seq)
            if pairs is not None:
                out.swap_out.extend(pairs)
                seq.status = SequenceStatus.SWAPPED
                seq.num_preemptions += 1
                self.swapped.append(seq)
                out.preempted.append(seq)
                self.events.emit("request_swap_out", request=seq.request_id, blocks=len(pairs))
                return
        discarded = seq.num_computed_tokens
        self.allocator.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.preemptions.append(PreemptionRecord(seq.request_id, self.step_index, discarded))
        self.tokens_discarded += discarded
        self.events.emit("request_preempt", request=seq.request_id, tokens_discarded=discarded)
