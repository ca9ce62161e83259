"""The samples of each live request: creating them, forking them after a shared prefill, letting them go.

A request asking for ``n`` samples is ``n`` sequences under one request id. Each sample draws from
its own sampler key; a request reserves its ``n`` keys in a row when it is added (sample i gets
the first + i), before any plugin runs, so a later request's random stream never depends on
whether an earlier one was forked or how its plugins answered.
"""

from __future__ import annotations

from pagedkv.core.events import EventLog
from pagedkv.core.kv.allocator_interface import Allocator
from pagedkv.core.sample.sampler import Sampler
from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.core.sched.scheduler_interface import Scheduler
from pagedkv.core.sched.sequence import Sequence
from pagedkv.core.stats import RunStats


class RequestGroups:
    """request id -> its sequences, and seq id -> its sampler key."""

    def __init__(self, sampler: Sampler, max_model_len: int, stats: RunStats, events: EventLog) -> None:
        self.sampler = sampler
        self.max_model_len = max_model_len
        self.stats = stats
        self.events = events
        self.by_request: dict[str, list[Sequence]] = {}
        self.keys: dict[int, int] = {}  # seq_id -> its sampler key
        self._next_key = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.by_request

    def __getitem__(self, request_id: str) -> list[Sequence]:
        return self.by_request[request_id]

    def reserve_keys(self, n: int) -> int:
        """The first of ``n`` consecutive sampler keys, taken for one request."""
        first, self._next_key = self._next_key, self._next_key + n
        return first

    def add(self, request_id: str, token_ids: list[int], params: SamplingParams, first_key: int, *,
            fork: bool, prompt: str | None = None, cache_salt: str | None = None) -> list[Sequence]:
        """The request's sequences: all ``n`` samples, or (``fork``) one parent that splits after its prefill."""
        seqs = [self._new_sample(request_id, token_ids, params, index, first_key + index, prompt, cache_salt)
                for index in range(1 if fork else params.n)]
        if fork:
            seqs[0].pending_forks = params.n - 1
        self.by_request[request_id] = seqs
        return seqs

    def fork(self, parent: Sequence, computed: int, allocator: Allocator, scheduler: Scheduler) -> list[Sequence]:
        """After its prefill, split a parent into its n samples sharing every block and ``computed`` tokens."""
        group = self.by_request[parent.request_id]
        children = []
        for _ in range(parent.pending_forks):
            index = len(group)  # parent.params carries seed + 0, so sample i gets seed + i as if unforked
            child = self._new_sample(parent.request_id, parent.prompt_token_ids, parent.params, index,
                                     self.keys[parent.seq_id] + index, parent.prompt, parent.cache_salt)
            child.priority, child.arrival, child.arrival_step = parent.priority, parent.arrival, parent.arrival_step
            allocator.fork(parent, child)
            if parent.matcher is not None:  # the child goes on from the parent's grammar state
                child.matcher = parent.matcher.copy()
            child.num_computed_tokens = computed
            scheduler.add_running(child)
            group.append(child)
            children.append(child)
        self.stats.blocks_shared_by_fork += parent.pending_forks * len(parent.block_table)
        parent.pending_forks = 0
        self.events.emit("request_fork", request=parent.request_id, children=len(children))
        return children

    def pop(self, request_id: str) -> list[Sequence] | None:
        """Let a request go (finished or aborted): its samples' sampler generators are dropped."""
        seqs = self.by_request.pop(request_id, None)
        for seq in seqs or ():
            key = self.keys.pop(seq.seq_id, None)
            if key is not None:
                self.sampler.forget(key)
        return seqs

    def _new_sample(self, request_id: str, token_ids: list[int], params: SamplingParams, index: int, key: int,
                    prompt: str | None, cache_salt: str | None) -> Sequence:
        seq = Sequence.sample_of(request_id, token_ids, params, index, self.max_model_len, prompt, cache_salt)
        self.keys[seq.seq_id] = key
        return seq
