"""The decode lane: running sequences in steady decode, moved forward by a clock instead of one by one.

In a simulated engine (``engine simulate``) every sampled token is 0 and a request
ends only by length, so a running sequence whose prompt is computed has a known
future: one more computed token and one more output token per step, a new block
each time its table fills, and a known last step. The lane holds such sequences
with the clock value they joined at; the scheduler and engine touch one only on
the step it crosses a block boundary or finishes (and, when a plugin such as the
prefix cache listens for full blocks, the step its block fills). A step's work
then grows with those events rather than with the running batch, which is what
makes 100k requests cheap to plan.

While a sequence is in the lane its ``num_computed_tokens`` and
``output_token_ids`` are stale; it is brought up to date (materialized) when it
leaves: on its finishing step, when it is aborted, or when the engine needs
every sequence exact (``flush``: a step with a preemption, a token budget too
small for the whole batch, a streaming step, an invariant check). The decisions
are those of the one-by-one step, in the same order: tests run both and compare
every figure and the block event sequence.

The calendars also say when the next thing happens at all (:meth:`DecodeLane.next_event`):
the simulator jumps the clock over the steps in between (:meth:`DecodeLane.skip`).
"""

from __future__ import annotations

import heapq
import itertools
from bisect import insort
from operator import attrgetter

from pagedkv.core.sched.sequence import Sequence

_run_order = attrgetter("run_order")


class _Member:
    __slots__ = ("joined", "computed", "last_step", "serial", "residue")

    def __init__(self, joined: int, computed: int, last_step: int, serial: int) -> None:
        self.joined = joined  # lane clock when it joined
        self.computed = computed  # its computed tokens then
        self.last_step = last_step  # the lane step it finishes on
        self.serial = serial  # tells a live calendar entry from one left behind by an earlier membership
        self.residue: int | None = None  # its crossing steps modulo the block size, once it is in a bucket


class DecodeLane:
    """Sequences that get exactly one token per step until a known step; see the module docstring."""

    def __init__(self, block_size: int, token: int = 0, report_fills: bool = False) -> None:
        self.block_size = block_size
        self.token = token  # the token every step samples (the simulated runner's only logit)
        self.clock = 0  # lane steps taken
        self.members: dict[Sequence, _Member] = {}
        self.outside: dict[Sequence, None] = {}  # running sequences not in the lane (prefilling, or just admitted)
        self.newest = -1  # largest run_order a member has had since the last flush (an upper bound)
        self._offset = 0  # sum over members of (computed at join - clock at join)
        # A member crosses into a new block every ``block_size`` steps: bucket r holds, in running order,
        # the members crossing on the lane steps congruent to r modulo the block size
        self._buckets: list[list[Sequence]] = [[] for _ in range(block_size)]
        self._finishes: dict[int, list[tuple[Sequence, int]]] = {}  # lane step -> members finishing then
        # lane step -> members whose last block becomes full then (for ``pagedkv_on_block_full`` plugins)
        self._fills: dict[int, list[tuple[Sequence, int]]] | None = {} if report_fills else None
        self._serials = itertools.count()
        self._event_steps: list[int] = []  # heap of lane steps with a calendar entry (some may be gone)

    def _book(self, calendar: dict[int, list[tuple[Sequence, int]]], step: int, entry: tuple[Sequence, int]) -> None:
        entries = calendar.get(step)
        if entries is None:
            calendar[step] = [entry]
            heapq.heappush(self._event_steps, step)
        else:
            entries.append(entry)

    def next_event(self) -> int | None:
        """The next lane step on which a member crosses a block boundary, fills a block or finishes
        (or an earlier one on which nothing happens: a calendar entry left behind by a former member)."""
        heap = self._event_steps
        fills = self._fills or {}
        while heap and (heap[0] <= self.clock or not (
            heap[0] in self._finishes or heap[0] in fills
        )):
            heapq.heappop(heap)
        nxt = heap[0] if heap else None
        buckets, clock, size = self._buckets, self.clock, self.block_size
        for ahead in range(1, size + 1 if nxt is None else min(size, nxt - clock - 1) + 1):
            if buckets[(clock + ahead) % size]:
                return clock + ahead
        return nxt

    def skip(self, steps: int) -> None:
        """``steps`` steps pass in which no member has an event (the caller checked :meth:`next_event`)."""
        self.clock += steps

    def tokens(self) -> int:
        """Computed tokens the members hold now (their context before the next step)."""
        return self._offset + len(self.members) * self.clock

    def counters(self, seq: Sequence) -> tuple[int, int]:
        """A member's (computed tokens, output tokens) now, without touching it."""
        member = self.members[seq]
        steps = self.clock - member.joined
        return member.computed + steps, len(seq.output_token_ids) + steps

    def enter(self, seq: Sequence) -> None:
        """A sequence started running (admitted, swapped in or forked); it waits outside until it decodes."""
        self.outside[seq] = None

    def join(self, seq: Sequence, steps_left: int) -> None:
        """Take in a running sequence that has just sampled and will decode ``steps_left`` more steps."""
        member = _Member(self.clock, seq.num_computed_tokens, self.clock + steps_left, next(self._serials))
        del self.outside[seq]
        self.members[seq] = member
        self._offset += member.computed - member.joined
        self.newest = max(self.newest, seq.run_order)
        self._book(self._finishes, member.last_step, (seq, member.serial))
        self._plan_crossing(seq, member)
        if self._fills is not None:
            self._plan_fill(seq, member, member.computed)

    def _plan_fill(self, seq: Sequence, member: _Member, computed: int) -> None:
        """Book the step after which the block that token ``computed`` goes into is full."""
        step = self.clock + self.block_size - computed % self.block_size
        if step <= member.last_step:
            self._book(self._fills, step, (seq, member.serial))

    def _plan_crossing(self, seq: Sequence, member: _Member) -> None:
        """A joining member goes in the bucket of the step it first needs a block on, if it ever does."""
        step = self.clock + len(seq.block_table.blocks) * self.block_size - member.computed + 1
        if step > member.last_step:
            return  # (a static reservation: never)
        if step - self.clock > self.block_size:  # the lane grows tables as the built-in allocators do
            raise RuntimeError(f"decode lane: {seq.request_id} holds more than a block of room ahead")
        member.residue = step % self.block_size
        insort(self._buckets[member.residue], seq, key=_run_order)

    def _live(self, entries: list[tuple[Sequence, int]]) -> list[Sequence]:
        members = self.members
        live = []
        for seq, serial in entries:
            member = members.get(seq)
            if member is not None and member.serial == serial:
                live.append(seq)
        return live

    def due_crossings(self) -> list[Sequence]:
        """Members that need a new block on the coming step, in running order (not yet taken)."""
        return list(self._buckets[(self.clock + 1) % self.block_size])

    def events_next(self) -> bool:
        """On the coming step a member finishes or fills a block (or may: a fill is not checked for liveness)."""
        step = self.clock + 1
        finishes = self._finishes.get(step)
        return bool(finishes and self._live(finishes) or self._fills is not None and step in self._fills)

    def advance(self) -> tuple[list[Sequence], list[Sequence], list[Sequence]]:
        """One step passed: every member decoded one token.

        Returns three lists in running order: the members that finish now (out of the lane), those
        whose last block became full now (some may be finishing too), and the union of the two,
        which are "owed" this step's sampled token. Those are brought up to date as one-by-one
        stepping has them between its computing and its sampling: counters after the step, output
        tokens before it; the engine appends the owed token where it appends sampled ones.
        """
        self.clock += 1
        filled: list[Sequence] = []
        if self._fills is not None:
            entries = self._fills.pop(self.clock, None)
            if entries:
                filled = self._live(entries)
                filled.sort(key=_run_order)
        entries = self._finishes.pop(self.clock, None)
        done = self._live(entries) if entries else []
        done.sort(key=_run_order)
        for seq in done:
            self._leave(seq, owe_last=True)
        owed = list(done)
        for seq in filled:
            member = self.members.get(seq)
            if member is not None:  # (a finishing one was brought up to date by leaving)
                self._sync(seq, member)
                self._plan_fill(seq, member, member.computed)
                owed.append(seq)
        return done, filled, owed

    def _sync(self, seq: Sequence, member: _Member) -> None:
        """Bring a member's counters up to date and its tokens up to the last step's; it stays in the lane."""
        steps = self.clock - member.joined
        member.computed += steps
        member.joined = self.clock  # (computed - joined) is unchanged, and so is the offset
        seq.num_computed_tokens = member.computed
        seq.output_token_ids.extend(itertools.repeat(self.token, steps - 1))  # this step's token is owed

    def discard(self, seq: Sequence) -> None:
        """A running sequence stops running (finished, aborted or preempted): materialize it if needed."""
        if seq in self.members:
            self._leave(seq)
        else:
            self.outside.pop(seq, None)

    def flush(self) -> None:
        """Materialize every member and move it outside: the next step goes one sequence at a time."""
        for seq in list(self.members):
            self._leave(seq)
            self.outside[seq] = None
        for bucket in self._buckets:
            bucket.clear()
        self._finishes.clear()
        if self._fills is not None:
            self._fills.clear()
        self._event_steps.clear()
        self.newest = -1

    def _leave(self, seq: Sequence, owe_last: bool = False) -> None:
        member = self.members.pop(seq)
        if member.residue is not None:
            self._buckets[member.residue].remove(seq)
        steps = self.clock - member.joined
        self._offset -= member.computed - member.joined
        seq.num_computed_tokens = member.computed + steps
        seq.output_token_ids.extend(itertools.repeat(self.token, steps - owe_last))
