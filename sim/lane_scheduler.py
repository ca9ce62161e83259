"""FCFS scheduling with a decode lane: the simulator's fast scheduler, deciding what FCFS decides.

:func:`with_decode_lane` derives, from :class:`~pagedkv.core.sched.scheduler.FCFSScheduler` or a
subclass that only reorders the waiting queue, a scheduler whose running sequences in
steady decode ride a :class:`~pagedkv.sim.decode_lane.DecodeLane`: the running
phase touches only those crossing a block boundary and those outside the lane, and
``update_from_output`` only those finishing or filling a block. When that shortcut could
decide differently (a preemption is possible, or the budget does not cover the whole
batch) the lane is flushed and the step runs one sequence at a time, as FCFS does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from pagedkv.core.kv.allocator import PagedAllocator, StaticAllocator
from pagedkv.core.sched.scheduler import FCFSScheduler, Sample, ScheduledSeq, SchedulerOutput, StepUpdate
from pagedkv.core.sched.sequence import Sequence, SequenceStatus
from pagedkv.sim.decode_lane import DecodeLane
from pagedkv.sim.simulated_runner import SimulatedRunner

_run_order = attrgetter("run_order")

# What a scheduler subclass may change and still ride the lane: the waiting order (``add``), its name.
_MAY_OVERRIDE = frozenset({"add", "name", "__init__", "__doc__", "__module__", "__qualname__", "__dict__",
                           "__weakref__", "__firstlineno__", "__static_attributes__"})


def lane_reproduces(scheduler_cls: Any, allocator: Any) -> bool:
    """The lane reproduces FCFS's running loop and the built-in allocators' block growth, not a subclass's own."""
    if type(allocator) not in (PagedAllocator, StaticAllocator):
        return False
    if not (isinstance(scheduler_cls, type) and issubclass(scheduler_cls, FCFSScheduler)):
        return False
    fcfs = set(vars(FCFSScheduler))
    for cls in scheduler_cls.__mro__[: scheduler_cls.__mro__.index(FCFSScheduler)]:
        if (set(vars(cls)) & fcfs) - _MAY_OVERRIDE:
            return False
    return True


def with_decode_lane(scheduler_cls: type) -> type:
    """``scheduler_cls`` with the decode lane mixed in (check :func:`lane_reproduces` first)."""
    return type(f"Laned{scheduler_cls.__name__}", (DecodeLaneScheduling, scheduler_cls), {})


@dataclass
class LaneOutput(SchedulerOutput):
    lane_decodes: int = 0  # decode-lane sequences also stepped (one token each); not in ``scheduled``
    lane_context: int = 0  # their cached tokens before this step, summed

    @property
    def num_batched_tokens(self) -> int:
        return super().num_batched_tokens + self.lane_decodes

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.lane_decodes


class DecodeLaneScheduling:
    """Mixed in before an FCFS scheduler class; see the module docstring."""

    lane: DecodeLane
    quiet = False  # the last step only moved the lane: nothing crossed, filled, finished, arrived or ran outside

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lane = DecodeLane(
            self.allocator.block_size, token=SimulatedRunner.TOKEN, report_fills=self.on_block_full is not None
        )

    def new_output(self) -> LaneOutput:
        return LaneOutput()

    def add(self, seq: Sequence) -> None:
        self.quiet = False
        super().add(seq)

    def _start_running(self, seq: Sequence) -> None:
        super()._start_running(seq)
        self.lane.enter(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        self.quiet = False
        if seq.status is SequenceStatus.RUNNING:
            self.lane.discard(seq)  # its counters exact before its blocks go back
        super().finish(seq, reason)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.lane.discard(seq)  # it has left the running list already
        super()._preempt(seq, out)

    def computed_tokens(self) -> int:
        lane = self.lane  # the running list is the lane plus the few outside it (and, at the KV peak probe,
        leaving = getattr(self, "_leaving", ())  # the members that left the lane this step and finish next)
        return lane.tokens() + sum(s.num_computed_tokens for s in lane.outside) + sum(
            s.num_computed_tokens for s in leaving)

    def _schedule_running(self, out: LaneOutput, budget: int) -> int:
        self.quiet = False
        if self.lane.members:
            left = self._schedule_with_lane(out, budget)
            if left is not None:
                return left
            self.lane.flush()  # this step may preempt or ration the budget: take it one sequence at a time
        return super()._schedule_running(out, budget)

    def _schedule_with_lane(self, out: LaneOutput, budget: int) -> int | None:
        """The running phase with a decode lane; returns the budget left, or None if the step must go one by one.

        Every lane member gets its one token; the few running sequences outside the lane get
        what the one-by-one loop would give them. Blocks are handed out in running order, as
        that loop does, so block ids come out the same. Declines when the budget would run
        out before a lane member or when the step's new blocks might not all fit.
        """
        lane = self.lane
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
            if grants is not wants or allocator.hooks is not None:
                return None  # a preemption would change what the rationed budget gives: go one by one
            return self._step_lane_preempting(out, budget, due, outside, wants)
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
        self.quiet = not due and not outside
        return budget - members - sum(grants)

    def _step_lane_preempting(
        self, out: LaneOutput, budget: int, due: list[Sequence], outside: list[Sequence], wants: list[int]
    ) -> int:
        """The lane step when its new blocks do not all fit (no plugins, the whole batch within budget).

        As FCFS's loop: in running order, each sequence that needs blocks gets them, or the newest
        running sequence is preempted until they fit (or it was the one that needed them). Members
        not crossing need nothing; preempted ones leave the lane (materialized) as in one-by-one stepping.
        """
        lane, allocator = self.lane, self.allocator
        pool = allocator.pool
        want = dict(zip(outside, wants))
        for seq in sorted(due + outside, key=_run_order):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted already, as the newest
            num_new = want.get(seq)
            while True:
                if num_new is not None:
                    if allocator.allocate_slots(seq, num_new):
                        break
                elif pool.num_available:  # a member crossing into its next block
                    seq.block_table.blocks.extend(pool.allocate_many(1, seq.request_id))
                    break
                victim = self.running.pop()  # the newest running sequence
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: nothing newer is left to run
        members = len(lane.members)
        out.lane_decodes, out.lane_context = members, lane.tokens()
        used = 0
        for seq in outside:
            if seq.status is SequenceStatus.RUNNING:
                out.scheduled.append(ScheduledSeq(seq, want[seq], seq.num_computed_tokens))
                used += want[seq]
        return budget - members - used

    def admission_floor(self) -> int | None:
        """With every running sequence on the lane and no allocator plugins: the fewest available blocks with
        which the next step's admission phase admits the head of the queue (FCFS's first check in
        ``_admit_waiting``: not crowded below the watermark, its blocks fit), or None if it admits nothing
        however many blocks are free (nothing waits, the batch is full, the lane takes the whole budget)."""
        budget = self.max_num_batched_tokens - len(self.lane.members)
        if not self.waiting or budget <= 0 or len(self.running) >= self.max_num_seqs:
            return None
        seq = self.waiting[0]
        return self.allocator.num_new_blocks(seq, min(seq.num_uncomputed, budget)) + max(self.watermark_blocks, 0)

    def cross(self, due: list[Sequence], events: bool = False) -> LaneOutput | None:
        """The scheduling of a step in which only the lane moves, members ``due`` (the coming step's
        crossings, in running order) each taking a new block; the caller checked that, if the blocks
        fit, nothing is admitted after them. If they do not fit, the newest sequences are preempted as
        in the real step (no plugin may choose how: ``hooks`` is None); then nothing is admitted either.

        Without ``events`` (the caller checked that no member finishes or fills a block then) the step
        is taken whole and its output returned only if it preempted. With ``events`` the step's output
        is returned for :meth:`update_from_output` to finish and report, as after :meth:`schedule`."""
        self.step_index += 1
        pool, lane = self.allocator.pool, self.lane
        out = LaneOutput() if events else None
        if len(due) <= pool.num_available:
            for seq, block in zip(due, pool.allocate_many(len(due))):
                seq.block_table.blocks.append(block)
            self.quiet = not due  # (members in a bucket cross again a block later: nothing to book)
        else:
            out = out or LaneOutput()
            self._step_lane_preempting(out, self.max_num_batched_tokens, due, [], [])
            self.quiet = False
        if events:
            out.lane_decodes, out.lane_context = len(lane.members), lane.tokens()
            self.quiet = False
        else:
            lane.advance()  # (no member finishes or fills a block: nothing is owed)
        return out

    def update_from_output(self, out: LaneOutput, samples: list[Sample]) -> StepUpdate:
        """FCFS's bookkeeping, with lane members touched only when they fill a block or finish.

        Full blocks are reported, and finishes made, in running order among the stepped sequences,
        as one-by-one stepping does (freed block ids depend on it). A sequence that sampled and
        goes on decoding joins the lane if only its length can end it.
        """
        lane = self.lane
        update = StepUpdate()
        ended: list[Sequence] = []
        filled: list[Sequence] = []  # members whose block filled: reported in running order among the rest
        owed: list[Sequence] = []  # members brought up to date but for this step's token
        if out.lane_decodes:
            ended, filled, owed = lane.advance()
        if filled or ended or out.scheduled or out.preempted or out.swap_in:
            self.quiet = False
        for item in out.scheduled:
            seq = item.seq
            while filled and filled[0].run_order < seq.run_order:
                seq_filled = filled.pop(0)  # (its counters are up to date: one block filled with its last token)
                self._report_full_blocks(seq_filled, seq_filled.num_computed_tokens - 1)
            self._advance(seq, item.num_new_tokens, update)
        for seq in filled:
            self._report_full_blocks(seq, seq.num_computed_tokens - 1)
        for seq, token, logprobs in samples:
            seq.append_token(token, logprobs)
        update.generated += len(samples) + out.lane_decodes
        for seq in owed:
            seq.output_token_ids.append(lane.token)
        self._leaving = ended  # out of the lane, still holding their blocks: counted at the KV peak
        try:
            self._probe_peak()
        finally:
            self._leaving = []
        if ended:  # finish in running order, as one-by-one stepping does
            samples = sorted([*samples, *((s, lane.token, None) for s in ended)], key=lambda item: item[0].run_order)
        for seq, token, _ in samples:
            self._finish_if_done(seq, token, update)
        for seq, *_ in samples:
            if seq.status is SequenceStatus.RUNNING:
                self._join_lane(seq)
        return update

    def _join_lane(self, seq: Sequence) -> None:
        """A sequence that sampled and goes on decoding rides the lane if its end is fixed by length."""
        lane = self.lane
        if seq not in lane.outside:
            raise RuntimeError(f"decode lane out of step: {seq.request_id} should have finished")
        if seq.pending_forks or not self.stop_check.ends_by_length_only(seq):
            return  # a token could end it: it stays outside and is stepped one by one
        p = seq.params
        n_out = len(seq.output_token_ids)
        lane.join(seq, min(p.max_tokens - n_out, seq.max_len - len(seq.prompt_token_ids) - n_out))
