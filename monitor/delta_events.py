"""How each delta event changes the monitor's block map and request table: one method per event kind.

:class:`~pagedkv.monitor.state.MonitorState` keeps the stream in order (hello, keyframes, gaps,
stats) and hands every event of an in-order delta to its method in :data:`HANDLERS`. The
methods work on the state's fields (``refs``, ``kept``, ``holders``, ``cpu_holders``,
``requests`` and the dirty sets) and mark what they change dirty for the views.
"""

from __future__ import annotations

from typing import Any


class DeltaEvents:
    """The event half of :class:`~pagedkv.monitor.state.MonitorState` (a mixin: the state owns the fields)."""

    refs: list[int]
    kept: set[int]
    holders: list[list[str]]
    cpu_holders: dict[int, str]
    requests: dict[str, Any]
    num_blocks: int
    dirty: set[int]
    dirty_cpu: set[int]
    dirty_requests: set[str]

    def _request(self, rid: str) -> Any:
        raise NotImplementedError

    def _finished(self, req: Any) -> None:
        raise NotImplementedError

    def _set(self, block: int, refs: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} is out of range 0..{self.num_blocks - 1}")
        self.refs[block] = refs
        self.dirty.add(block)

    def _drop_holders(self, block: int) -> None:
        for rid in self.holders[block]:
            req = self.requests.get(rid)
            if req is not None and block in req.blocks:
                req.blocks.remove(block)
                self.dirty_requests.add(rid)
        self.holders[block] = []

    def _hold(self, block: int, owner: Any) -> None:
        if owner is None:
            return
        rid = str(owner)
        self.holders[block].append(rid)
        req = self._request(rid)
        if block not in req.blocks:
            req.blocks.append(block)
            self.dirty_requests.add(rid)

    def _ev_alloc(self, d: dict) -> None:
        b = d["block"]
        self._set(b, 1)
        self.kept.discard(b)
        self._drop_holders(b)
        self._hold(b, d.get("owner"))

    def _ev_share(self, d: dict) -> None:
        b = d["block"]
        self._set(b, int(d["refs"]))
        self.kept.discard(b)
        self._hold(b, d.get("owner"))

    def _ev_unshare(self, d: dict) -> None:
        b = d["block"]
        self._set(b, int(d["refs"]))
        owner = d.get("owner")
        if owner is None:
            return
        rid = str(owner)
        if rid in self.holders[b]:
            self.holders[b].remove(rid)
        req = self.requests.get(rid)
        if req is not None and rid not in self.holders[b] and b in req.blocks:
            req.blocks.remove(b)
            self.dirty_requests.add(rid)

    def _ev_keep(self, d: dict) -> None:
        b = d["block"]
        self._set(b, 0)
        self._drop_holders(b)
        self.kept.add(b)

    def _ev_free(self, d: dict) -> None:
        b = d["block"]
        self._set(b, 0)
        self._drop_holders(b)
        self.kept.discard(b)

    def _ev_evict(self, d: dict) -> None:
        self._ev_free(d)

    def _ev_cow(self, d: dict) -> None:
        src, dst, owner = d["src"], d["dst"], d.get("owner")
        self.dirty.update((src, dst))
        req = self.requests.get(str(owner)) if owner is not None else None
        if req is not None and src in req.blocks and dst not in req.blocks:
            req.blocks[req.blocks.index(src)] = dst  # keep the logical position
            self.dirty_requests.add(req.id)

    def _ev_swap_out(self, d: dict) -> None:
        cpu, owner = d["cpu_block"], d.get("owner")
        if owner is None:
            return
        self.cpu_holders[cpu] = str(owner)
        self.dirty_cpu.add(cpu)
        req = self._request(str(owner))
        req.cpu_blocks.append(cpu)
        req.state = "swapped"
        self.dirty_requests.add(req.id)

    def _ev_swap_in(self, d: dict) -> None:
        cpu, owner = d["cpu_block"], d.get("owner")
        holder = self.cpu_holders.pop(cpu, None)
        self.dirty_cpu.add(cpu)
        req = self.requests.get(str(owner if owner is not None else holder))
        if req is not None and cpu in req.cpu_blocks:
            req.cpu_blocks.remove(cpu)
            self.dirty_requests.add(req.id)
        if self.refs[d["block"]] == 0:
            self._ev_alloc({"block": d["block"], "owner": owner if owner is not None else holder})

    def _ev_request_add(self, d: dict) -> None:
        req = self._request(str(d["request"]))
        req.state, req.prompt = "waiting", int(d.get("prompt_tokens", 0))
        req.samples = max(1, int(d.get("n", 1)))
        self.dirty_requests.add(req.id)

    def _ev_request_schedule(self, d: dict) -> None:
        req = self._request(str(d["request"]))
        if req.state != "running":
            req.state = "running"
            self.dirty_requests.add(req.id)

    def _ev_request_preempt(self, d: dict) -> None:
        req = self._request(str(d["request"]))
        req.state = "waiting"
        req.preemptions += 1
        req.computed = 0
        self.dirty_requests.add(req.id)

    def _ev_request_finish(self, d: dict) -> None:
        req = self._request(str(d["request"]))
        req.samples -= 1
        if "generated" in d:  # the final count, the last sampled token included (progress lags it by one)
            req.finished_generated += int(d["generated"])
        if req.samples <= 0 and req.state != "finished":
            req.finish_reason = d.get("reason")
            self._finished(req)
            if "generated" in d:
                req.generated = req.finished_generated
        self.dirty_requests.add(req.id)

    def _ev_request_swap_out(self, d: dict) -> None:
        req = self._request(str(d["request"]))
        req.state = "swapped"
        self.dirty_requests.add(req.id)

    def _ev_request_swap_in(self, d: dict) -> None:
        req = self._request(str(d["request"]))
        req.state = "running"
        self.dirty_requests.add(req.id)


HANDLERS = {
    "request_swap_out": DeltaEvents._ev_request_swap_out,
    "request_swap_in": DeltaEvents._ev_request_swap_in,
    "request_fork": lambda self, d: None,
    "block_alloc": DeltaEvents._ev_alloc,
    "block_share": DeltaEvents._ev_share,
    "block_unshare": DeltaEvents._ev_unshare,
    "block_keep": DeltaEvents._ev_keep,
    "block_free": DeltaEvents._ev_free,
    "block_evict": DeltaEvents._ev_evict,
    "block_cow": DeltaEvents._ev_cow,
    "block_swap_out": DeltaEvents._ev_swap_out,
    "block_swap_in": DeltaEvents._ev_swap_in,
    "request_add": DeltaEvents._ev_request_add,
    "request_schedule": DeltaEvents._ev_request_schedule,
    "request_preempt": DeltaEvents._ev_request_preempt,
    "request_finish": DeltaEvents._ev_request_finish,
}
