"""Rank 0 -> every rank: one broadcast per step, sent without waiting.

A message is pickled into a byte tensor of the channel's capacity: an 8-byte length, then
the bytes. When a message outgrows the capacity, that first broadcast carries only the
length; both sides then grow the capacity (next power of two) and a second broadcast
carries the bytes, so a steady run pays one collective per step. Rank 0 sends
asynchronously and never blocks on a rank that stopped reading: a hung rank is caught by
the layers' all-reduces, which time out (``torch.distributed.broadcast_object_list`` would
block rank 0 for the group's idle-length timeout instead).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

HEADER = 8
INITIAL_CAPACITY = 1 << 16


class StepChannel:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.capacity = INITIAL_CAPACITY
        self._pending: list[Any] = []  # rank 0's sends in flight (and their buffers, kept alive)

    def send(self, message: Any) -> None:
        """Rank 0: start broadcasting ``message``; the previous send has completed by now (the ranks ran its step)."""
        for work, _ in self._pending:
            work.wait()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        first = torch.zeros(HEADER + self.capacity, dtype=torch.uint8)
        first[:HEADER] = _length_bytes(len(data))
        buffers = [first]
        if len(data) <= self.capacity:
            first[HEADER:HEADER + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            self.capacity = _grown(len(data))
            second = torch.zeros(HEADER + self.capacity, dtype=torch.uint8)
            second[HEADER:HEADER + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            buffers.append(second)
        self._pending = []
        for buffer in buffers:
            buffer = buffer.to(self.device)
            self._pending.append((dist.broadcast(buffer, src=0, async_op=True), buffer))

    def receive(self) -> Any:
        """Every other rank: wait (as long as rank 0 idles) for the next message."""
        buffer = torch.empty(HEADER + self.capacity, dtype=torch.uint8, device=self.device)
        dist.broadcast(buffer, src=0)
        length = int.from_bytes(bytes(buffer[:HEADER].cpu().tolist()), "little")
        if length > self.capacity:
            self.capacity = _grown(length)
            buffer = torch.empty(HEADER + self.capacity, dtype=torch.uint8, device=self.device)
            dist.broadcast(buffer, src=0)
        return pickle.loads(buffer[HEADER:HEADER + length].cpu().numpy().tobytes())


def _length_bytes(length: int) -> torch.Tensor:
    return torch.tensor(list(length.to_bytes(HEADER, "little")), dtype=torch.uint8)


def _grown(length: int) -> int:
    return 1 << (length - 1).bit_length()
